"""``CopyFence``: the end of copies launched on the current stream, and its
events handed on for reuse. On the CPU a fence has always passed; on a GPU it
passes only once the copies before it have run, reused events included."""

import pytest
import torch

from kvstage.staging.fence import CopyFence


def test_a_cpu_fence_has_passed_at_once():
    f = CopyFence(torch.device("cpu")).close()
    assert f.started() and f.done() and f.gpu_seconds() is None
    f.wait()
    f.release()  # nothing to hand on


@pytest.mark.gpu
def test_released_events_serve_the_next_fence_and_still_fence():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    dev = torch.device("cuda", 0)
    a = torch.ones(1 << 26, dtype=torch.uint8, device=dev)
    b = torch.empty_like(a)
    first = CopyFence(dev)
    b.copy_(a)
    first.close().wait()
    took = first.gpu_seconds()
    assert first.done() and took > 0
    events = (first._start, first._end)
    first.release()
    second = CopyFence(dev)
    assert (second._start, second._end) == events  # reused, not made anew
    torch.cuda._sleep(50_000_000)  # keep the stream busy: the reused end event must not read as passed
    for _ in range(4):
        b.copy_(a)
    second.close()
    assert not second.done()
    second.wait()
    assert second.done() and second.gpu_seconds() > took
    assert bool((b == 1).all())


@pytest.mark.gpu
def test_a_fence_has_started_only_once_the_work_queued_before_it_ran():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    dev = torch.device("cuda", 0)
    torch.cuda._sleep(50_000_000)  # work queued before the fence
    f = CopyFence(dev).close()
    assert not f.started() and not f.done()
    f.wait()
    assert f.started() and f.done()
    f.release()


@pytest.mark.gpu
def test_a_fence_marks_the_stream_current_when_it_is_made_and_closed():
    """Copies on the default stream are fenced there (its Stream object built once);
    copies on another current stream are fenced on that one."""
    from kvstage.staging.cuda_copy import current_stream, default_stream

    dev = torch.device("cuda", 0)
    assert current_stream(dev) is default_stream(dev) is current_stream(dev)
    side = torch.cuda.Stream(dev)
    with torch.cuda.stream(side):
        assert current_stream(dev).cuda_stream == side.cuda_stream
        fence = CopyFence(dev)
        torch.cuda._sleep(50_000_000)  # the side stream is busy; the default stream is not
        fence.close()
    assert not fence.done()
    torch.cuda.default_stream(dev).synchronize()
    assert not fence.done()  # fenced on the side stream, not on the default one
    fence.wait()
    assert fence.done()
