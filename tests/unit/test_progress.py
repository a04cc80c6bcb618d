"""The driver's record of a run's progress: restarts, and whether a resume repeated the steps
it redid exactly."""

from __future__ import annotations

from rayzip.progress import Progress


def _run(progress: Progress, pid: int, steps: range, loss, world: int = 2) -> None:
    for step in steps:
        progress.update({"step": step, "pid": pid, "loss": loss(step), "world_size": world})


def test_an_exact_resume_repeats_the_redone_steps_loss_bit_for_bit():
    progress = Progress(dead_nodes=set)
    _run(progress, 1, range(0, 30), lambda s: 1.0 / (s + 1))
    _run(progress, 2, range(20, 40), lambda s: 1.0 / (s + 1))  # resumed at 20: 10 steps redone
    restarts = progress.get_restarts()
    assert restarts["restarts"] == 1 and restarts["steps_redone"] == 10
    assert restarts["replayed"] == {"steps": 10, "identical": 10, "first_difference": None}


def test_a_resume_that_lost_state_is_seen_at_its_first_different_step():
    progress = Progress(dead_nodes=set)
    _run(progress, 1, range(0, 30), lambda s: 1.0 / (s + 1))
    # The first redone step is the same (the weights came back), the next differs in the last
    # bit (say, the error-feedback residual was lost).
    _run(progress, 2, range(20, 40), lambda s: 1.0 / (s + 1) if s == 20 else float.fromhex((1.0 / (s + 1)).hex()) * (1 + 2**-52))
    assert progress.get_restarts()["replayed"] == {"steps": 10, "identical": 1, "first_difference": 21}


def test_a_second_resume_compares_with_the_last_attempt_that_reached_each_step():
    progress = Progress(dead_nodes=set)
    _run(progress, 1, range(0, 30), lambda s: float(s))
    _run(progress, 2, range(20, 25), lambda s: float(s))
    _run(progress, 3, range(22, 31), lambda s: float(s))  # 22..24 redone again, 25..29 the first's
    replayed = progress.get_restarts()["replayed"]
    assert replayed == {"steps": 5 + 3 + 5, "identical": 13, "first_difference": None}, replayed


def test_each_restart_names_its_cause_from_the_nodes_and_the_world_size():
    dead = {"old"}  # a node dead before the run: not this run's loss
    progress = Progress(dead_nodes=lambda: set(dead))
    _run(progress, 1, range(0, 10), float)
    _run(progress, 2, range(10, 20), float)  # a worker process died; the same world came back
    dead.add("n2" * 20)
    _run(progress, 3, range(19, 30), float, world=1)  # its node died with it
    _run(progress, 4, range(30, 40), float, world=2)  # a node joined: Ray Train grew the group
    _run(progress, 5, range(40, 50), float, world=1)  # fewer workers, but no node died
    resumes = progress.get_restarts()["resumes"]
    assert [(r["cause"], r["world_before"], r["world_after"]) for r in resumes] == [
        ("worker_failure", 2, 2), ("node_lost", 2, 1), ("scale_up", 1, 2), ("worker_failure", 2, 1)]
    assert [r["nodes_lost"] for r in resumes] == [[], ["n2" * 20], [], []]
    assert resumes[1]["steps_lost"] == 1 and resumes[1]["resumed_at"] == 19


def test_a_post_lost_with_its_killed_rank_still_counts_the_step_the_resume_proves_done():
    # Rank 0 posted steps 0..129, was killed before its post of step 130 left the process,
    # and the group resumed at 131 from a snapshot of step 130.
    progress = Progress(dead_nodes=set)
    _run(progress, 1, range(0, 130), float)
    _run(progress, 2, range(131, 140), float)
    (resume,) = progress.get_restarts()["resumes"]
    assert (resume["last_step"], resume["resumed_at"], resume["steps_lost"]) == (130, 131, 0), resume
