import flashattn2

flashattn2.install_as_flash_attn()
from flash_attn.flash_attn_interface import _flash_attn_backward, _flash_attn_forward  # noqa: E402, F401
