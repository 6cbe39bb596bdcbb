"""tools/sass_loops.py finds a kernel's loops in cuobjdump -sass text (a backward branch closes one) and counts
their opcodes without predicate guards or modifiers. Synthetic SASS: no GPU, no compiler."""

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tools"))
import sass_loops  # noqa: E402

_SASS = """
	code for sm_90a
		Function : k
        /*0000*/                   MOV R1, c[0x0][0x28] ;                                   /* 0x00000a0000017a02 */
        /*0010*/                   S2R R0, SR_TID.X ;                                       /* 0x0000000000007919 */
        /*0020*/              @!P0 BRA 0x90 ;                                               /* 0x0000006000008947 */
        /*0030*/                   ISETP.GT.AND P1, PT, R3, R5, PT ;                        /* 0x000000050300720c */
        /*0040*/                   FSEL R4, R4, -INF , !P1 ;                                /* 0x ff80000004047808 */
        /*0050*/                   FFMA R4, R4, R6, -R7 ;                                   /* 0x0000000604047223 */
        /*0060*/                   MUFU.EX2 R4, R4 ;                                        /* 0x0000000400047308 */
        /*0070*/               @P2 BRA 0x30 ;                                               /* 0xffffffb000002947 */
        /*0080*/                   SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR4], R2 ;           /* 0x000000ff0000758d */
        /*0090*/              @!P0 BRA 0x80 ;                                               /* 0xfffffff000008947 */
        /*00a0*/                   EXIT ;                                                   /* 0x000000000000794d */
"""


def test_loops_and_their_opcodes():
    instrs = sass_loops.parse(_SASS)
    assert len(instrs) == 11 and instrs[3] == (0x30, "ISETP.GT.AND P1, PT, R3, R5, PT")
    assert sass_loops.opcode("@!P0 BRA 0x90") == "BRA" and sass_loops.opcode("MUFU.EX2 R4, R4") == "MUFU"
    found = sass_loops.loops(instrs)
    # the forward branch at 0x20 closes nothing; the try-wait spin (2 instructions) sorts before the 5-instruction loop
    assert [(lo, hi, sum(c.values())) for lo, hi, c in found] == [(0x80, 0x90, 2), (0x30, 0x70, 5)]
    assert found[1][2] == {"ISETP": 1, "FSEL": 1, "FFMA": 1, "MUFU": 1, "BRA": 1}
    assert sass_loops.loops(instrs, min_len=3) == found[1:]


def test_sass_mix_summarizes_and_compares():
    """tools/sass_mix.py's numbers of one kernel (registers and local memory from -res-usage, spills, wgmma and
    loops from the SASS) and its comparison with another Triton's line."""
    import sass_mix

    resources = "Function k:\n REG:168 STACK:16 SHARED:0 LOCAL:0 CONSTANT[0]:532 TEXTURE:0 SURFACE:0 SAMPLER:0\n"
    extra = "        /*00b0*/                   STL [R1], R4 ;  /* 0x0 */\n        /*00c0*/   HGMMA.64x64x16.F32 R24, gdesc[UR4], R24 ;  /* 0x0 */\n"
    numbers = sass_mix.summarize(_SASS + extra, resources)
    assert (numbers["regs"], numbers["stack"], numbers["spill_stores"], numbers["spill_loads"]) == (168, 16, 1, 0)
    assert numbers["instructions"] == 13 and numbers["hgmma"] == 1 and numbers["loops"] == []
    other = dict(numbers, spill_loads=4, loops=[70])
    assert sass_mix.differences(other, numbers) == {"spill_loads": [0, 4], "loops": [[], [70]]}
    assert sass_mix.differences(numbers, numbers) == {}
