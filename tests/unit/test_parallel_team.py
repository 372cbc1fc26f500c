"""The decoder stack's team of threads (csrc/team.h): one OpenMP region for a whole step,
whose kernels' parallel loops split their items exactly as at::parallel_for does, reach
every thread, and pass an error in any share back to the caller without leaving a thread
behind."""

from __future__ import annotations

import pytest
import torch

from llmserve.csrc import cpu_ops

pytestmark = pytest.mark.skipif(
    cpu_ops() is None, reason="the compiled CPU kernels are not built here (no C++ compiler, or "
    "LLMSERVE_CPU_KERNELS=0); runs wherever they build, as in make test")


@pytest.fixture(autouse=True)
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


# (items, grain): below, at and above the grain; fewer items than threads; grain 0.
SPLITS = [(1, 1), (2, 1), (3, 1), (5, 2), (7, 0), (16, 16), (17, 16), (40, 16), (1000, 1)]


@pytest.mark.parametrize(("n", "grain"), SPLITS, ids=str)
def test_a_team_splits_a_loop_as_at_parallel_for(n, grain):
    team = cpu_ops().parallel_shares(n, grain, 3, True)
    alone = cpu_ops().parallel_shares(n, grain, 3, False)
    assert (team[..., 1] >= 0).all(), "an item was not computed"
    assert torch.equal(team[..., 0], alone[..., 0])  # the same shares
    # and each share on the thread at::parallel_for gives it
    assert torch.equal(team[..., 1], alone[..., 1])
    if n > max(grain, 1):
        assert set(team[..., 1].flatten().tolist()) == {0, 1}


def test_a_team_runs_many_loops_in_one_region():
    shares = cpu_ops().parallel_shares(2, 1, 5000, True)
    assert torch.equal(shares[:, :, 1], torch.tensor([[0, 1]]).expand(5000, 2))


@pytest.mark.parametrize("fail_at", [5, 30], ids=["leader's share", "other thread's share"])
def test_an_error_in_a_share_reaches_the_caller(fail_at):
    with pytest.raises(RuntimeError, match=f"item {fail_at} failed"):
        cpu_ops().parallel_shares(40, 16, 3, True, fail_at)
    # No thread was left waiting: the next team forms and computes every item.
    shares = cpu_ops().parallel_shares(40, 16, 3, True)
    assert (shares[..., 1] >= 0).all()


@pytest.mark.parametrize("slow_item", [0, 1], ids=["leader slow", "other thread slow"])
def test_threads_that_wait_long_sleep_and_are_woken(slow_item):
    """A share of 2 ms: the thread waiting on it (the leader for the other thread's share, the
    other thread for the leader's next loop) outlasts its spin and sleeps on the futex; each
    of 20 loops still runs both shares."""
    shares = cpu_ops().parallel_shares(2, 1, 20, True, slow_item=slow_item)
    assert torch.equal(shares[:, :, 1], torch.tensor([[0, 1]]).expand(20, 2))
