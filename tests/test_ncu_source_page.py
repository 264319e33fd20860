"""``tools/ncu_backward.py --source`` (outside the package): its reading of Nsight Compute's SASS source page (CSV),
checked on a small page written as ncu writes one: offsets, samples, the loops a backward branch closes and the
hottest instructions."""
import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _tool():
    spec = importlib.util.spec_from_file_location("ncu_backward", ROOT / "tools" / "ncu_backward.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


HEAD = ('"Address","Source","Warp Stall Sampling (All Samples)","Warp Stall Sampling (Not-issued Samples)",'
        '"Instructions Executed","stall_long_sb","stall_wait","stall_long_sb (Not Issued)"')


def _row(addr, sass, samples, executed, long_sb, wait):
    return f'"{hex(addr)}","      {sass}","{samples}","{samples}","{executed}","{long_sb}","{wait}","0"'


def test_source_page_rows_loops_and_hottest_instructions():
    base = 0x7F0000001000
    page = "\n".join([
        '"Kernel Name","flash_bwd_wide_tile",', HEAD,
        _row(base, "LDC R1, c[0x0][0x28]", 2, 128, 0, 2),
        _row(base + 0x10, "HGMMA.64x128x16.F32.BF16 R24, gdesc[UR4], R24", 30, 4096, 0, 30),
        _row(base + 0x20, "SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR8+0x30990], R13", 8, 4096, 8, 0),
        _row(base + 0x30, f"@P1 BRA {hex(base + 0x10)}", 50, 4096, 45, 5),
        _row(base + 0x40, "EXIT", 10, 128, 0, 10),
    ])
    tool = _tool()
    rows = tool.parse_source_page(page)
    assert [r[0] for r in rows] == [0, 0x10, 0x20, 0x30, 0x40]
    assert rows[3][2:4] == (50, 4096) and rows[3][4] == {"long_sb": 45, "wait": 5} and rows[3][5] == 0x10
    assert rows[1][5] is None
    text = tool.summarize_source(rows, top=2)
    assert "long_sb 0.530" in text and "wait 0.470" in text  # of 100 samples
    assert "| 000010-000030 | 3 | 0.880 | 4096 | 0.021 |" in text  # the loop the branch closes
    hottest = [line for line in text.splitlines() if line.startswith("| 0000")]
    assert hottest[-2].startswith("| 000030 | 0.500 |") and hottest[-1].startswith("| 000010 | 0.300 |")


def test_source_page_without_a_source_table_gives_no_rows():
    assert _tool().parse_source_page('"ID","Kernel Name"\n"0","x"\n') == []
