"""What of the copy-engine transfers runs without a GPU beside the simulated machine's tests
(test_copy_engine_protocol.py, test_copy_engine_failures.py): the watchdog that ends a process whose peer never
answers, the argument checks of ``copy_rows``, the choice of transport. (The transfers themselves are checked on 2
GPUs by tools/gpu_sp_check.py and tools/copy_engine_soak.py: bitwise equal to NCCL's.)"""
import pytest
import torch

from longattn.distributed import copy_engine


class _Event:
    def __init__(self, done: bool):
        self.done = done

    def query(self) -> bool:
        return self.done


def test_watchdog_ends_the_process_only_when_a_transfer_waits_too_long(capsys):
    now = [0.0]
    exits = []
    dog = copy_engine._Watchdog(exit=exits.append, clock=lambda: now[0], period=3600.0)
    dog.track(_Event(True), _Event(True), "done", 10.0)
    stuck = _Event(False)
    dog.track(_Event(True), stuck, "group-7", 10.0)
    assert not dog.check() and not exits  # (the stuck wait is reached now: its clock starts)
    now[0] = 5.0
    assert not dog.check() and not exits
    assert [w.what for w in dog.pending] == ["group-7"]  # the completed one is dropped
    now[0] = 11.0
    assert dog.check() and exits == [1]
    assert "group-7" in capsys.readouterr().err
    stuck.done = True  # once the peer answers, nothing is pending
    exits.clear()
    assert not dog.check() and dog.pending == [] and not exits


class _BrokenEvent:
    def query(self) -> bool:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")


def test_watchdog_outlives_an_event_whose_query_raises(capsys):
    """An event whose query raises (a sticky CUDA error) must not end the watchdog's thread: a peer stuck later
    still ends the process (the thread died, and every later wait went unwatched: a hang); the broken wait itself
    is timed from its first failed query, its error in the message."""
    import time

    exits = []
    dog = copy_engine._Watchdog(exit=exits.append, period=0.01)
    dog.track(_Event(True), _BrokenEvent(), "broken", 3600.0)
    time.sleep(0.05)
    dog.track(_Event(True), _Event(False), "stuck", 0.05)
    deadline = time.monotonic() + 3.0
    while not exits and time.monotonic() < deadline:
        time.sleep(0.01)
    assert exits == [1] and "'stuck'" in capsys.readouterr().err
    now, exits = [0.0], []
    dog = copy_engine._Watchdog(exit=exits.append, clock=lambda: now[0], period=3600.0)
    dog.track(_Event(False), _BrokenEvent(), "broken", 10.0)
    assert not dog.check() and not exits
    now[0] = 11.0
    assert dog.check() and exits == [1] and "illegal memory access" in capsys.readouterr().err


def test_copy_rows_refuses_mismatched_or_overlapping_rows():
    stream = None  # never reached: the checks come first
    with pytest.raises(ValueError, match="shapes/dtypes differ"):
        copy_engine.copy_rows(torch.zeros(2, 3), torch.zeros(3, 2), stream)
    with pytest.raises(ValueError, match="last dimension must be contiguous"):
        copy_engine.copy_rows(torch.zeros(3, 2).t(), torch.zeros(2, 3), stream)
    with pytest.raises(ValueError, match="rows overlap"):
        copy_engine.copy_rows(torch.zeros(2, 3), torch.zeros(1, 3).expand(2, 3), stream)


def test_as_rows_keeps_rows_under_the_pitch_limit():
    assert copy_engine.as_rows(torch.zeros(4, 5)).shape == (1, 20)
    big = torch.empty((1 << 29) + 64, dtype=torch.float16).view(-1, 64)  # 1 GiB + 128 B: several rows
    rows = copy_engine.as_rows(big)
    assert rows.shape[0] > 1 and rows.shape[1] * 2 <= 1 << 30 and rows.numel() == big.numel()


def test_workspace_sizes():
    assert copy_engine.nbytes((2, 3, 4), torch.bfloat16) == 48 and copy_engine.nbytes((), torch.float64) == 8
    assert [copy_engine.align(n) for n in (0, 1, 256, 257)] == [0, 256, 256, 512]


def test_auto_transport_picks_nccl(monkeypatch):
    """``ParallelOptions(transport="auto")`` (the default) moves the ring's blocks and Ulysses' all-to-alls through
    NCCL: the copy engines are asked for only when chosen explicitly, with the options' timeout."""
    from types import SimpleNamespace

    from longattn.distributed import ParallelOptions, all_to_all, transport

    asked = []
    monkeypatch.setattr(copy_engine, "link", lambda *a, **kw: asked.append((a, kw)) or None)
    monkeypatch.setattr(transport, "group_size_rank", lambda group: (2, 0))
    monkeypatch.setattr(transport, "global_rank", lambda group, r: r)
    assert ParallelOptions().transport == "auto"
    assert transport.Ring(None, ParallelOptions(), torch.device("cuda", 0)).link is None and not asked
    monkeypatch.setattr(all_to_all, "NcclRoute", lambda *a: "nccl")
    x = SimpleNamespace(is_cuda=True, device=torch.device("cuda", 0))
    plan = all_to_all.Plan(None, 2, 0, 4, 4, ((0,), (4,)))
    route = all_to_all.open_route(plan, [[all_to_all.Part(x, 0, 1)]], [], fresh=False, options=ParallelOptions())
    assert route == "nccl" and not asked
    with pytest.raises(RuntimeError, match="ParallelOptions.transport='copy_engine' but copy-engine transfers cannot "
                                           "run"):
        transport.Ring(None, ParallelOptions(transport="copy_engine", copy_engine_timeout_s=5.0),
                       torch.device("cuda", 0))
    assert len(asked) == 1 and asked[0][1] == {"timeout_s": 5.0}


@pytest.mark.parametrize("hit", [False, True])
def test_results_become_nan_only_where_a_flag_holds_the_abort_mark(hit):
    """The check at a call's end (``poison``): the kernel (interpreted here; a grid smaller than the result, so its
    loop runs) and the masked fill it falls back to leave a result alone unless a flag holds the aborting
    rank's number exactly (a peer's next call writes the next number, which is no abort)."""
    from longattn.distributed import poison

    mark = 5 + copy_engine.ABORTED
    flags = torch.arange(130, dtype=torch.int64) + 6  # (the next calls' numbers)
    if hit:
        flags[77] = mark
    out = torch.randn(5000)
    want = torch.full_like(out, float("nan")) if hit else out.clone()
    fallback = out.clone()
    poison.poison(flags, mark, [fallback])
    assert torch.equal(fallback.isnan(), want.isnan()) and torch.equal(fallback.nan_to_num(), want.nan_to_num())
    if poison.triton is not None:
        poison._poison_kernel[(2,)](flags, flags.numel(), mark, out, out.numel(), FLAG_BLOCK=256, BLOCK=1024)
        assert torch.equal(out.isnan(), want.isnan()) and torch.equal(out.nan_to_num(), want.nan_to_num())


def test_retire_records_what_an_aborted_call_leaves_to_its_side_streams():
    """A call's end (``joined``: the caller's stream waited for the side streams) lets its tensors go as they are;
    an abort does not wait for the side streams (they may wait for a peer), so each tensor is recorded on each of
    them: the caching allocator must not give its memory to a new tensor while a queued copy still reads it (the
    simulated machine checks that the protocol says which; tests/gpu checks the allocator)."""
    class _Tensor:
        def __init__(self):
            self.streams = []

        def record_stream(self, stream):
            self.streams.append(stream)

    ended, aborted = _Tensor(), [_Tensor(), _Tensor()]
    copy_engine.CudaRuntime().retire([ended], ["send", "local"])
    copy_engine.CudaRuntime().retire(aborted, ["send", "local"], joined=False)
    assert ended.streams == [] and [t.streams for t in aborted] == [["send", "local"]] * 2
