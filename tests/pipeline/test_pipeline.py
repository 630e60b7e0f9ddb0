"""Pipeline parallel under real torchrun: a real SIGKILL of one or more stages, torchrun restarts every
worker, healthy stages resume their live state in place (zero recomputation, counted), failed stages
recover from their window and their neighbours' boundary logs. Every stage's final state (parameters,
exp_avg, exp_avg_sq, step, LR, expert bias, token counters) and the loss sequence must be `torch.equal` to
the fault-free run of the same spec."""

import pytest

from torchmoe_harness.launch import compare, launch, load_result

pytestmark = pytest.mark.torchrun  # starts torchrun/gloo processes or servers: not in make test-fast

MODULE = "torchmoe_harness.pipeline_worker"
RUN = {"steps": 9, "model": {"n_layers": 3}, "batch_size": 4}


def spec(tmp, stages: int, schedule: str = "1f1b", **pipeline) -> dict:
    return {
        "run": RUN,
        "pipeline": {"stages": stages, "microbatches": 2, "schedule": schedule, **pipeline},
        "checkpoint": {"window": 3, "bandwidth_bytes_per_s": 1e9},
        "host_tier": {"root": str(tmp / "shm"), "run_id": "t"},
        "timeout_s": 30,
    }


def run_pp(tmp, s: dict, faults: str = "", restarts: int = 0):
    out = tmp / "run"
    (tmp / "faults").mkdir(exist_ok=True)
    log = launch(
        s["pipeline"]["stages"],
        s,
        out,
        timeout=150,
        module=MODULE,
        max_restarts=restarts,
        extra_env={"TORCHMOE_FAULT": faults, "TORCHMOE_FAULT_STATE": str(tmp / "faults")},
    )
    return load_result(out, s["pipeline"]["stages"], log)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    cache = {}

    def get(stages: int, schedule: str = "1f1b"):
        if (stages, schedule) not in cache:
            tmp = tmp_path_factory.mktemp("ppref")
            cache[stages, schedule] = run_pp(tmp, spec(tmp, stages, schedule))
        return cache[stages, schedule]

    return get


@pytest.mark.parametrize("stages, schedule", [(3, "1f1b"), (2, "gpipe"), (3, "gpipe")])
def test_fault_free_reference(reference, stages, schedule):
    """The fault-free runs the failure tests compare against, each its own test item (so the 60 s limit of a
    failure test never includes one)."""
    ref = reference(stages, schedule)
    assert len(ref.states) == stages and not ref.report.get("recoveries"), ref.report
    assert all(len(losses) == RUN["steps"] for losses in ref.losses)


def check(run, ref, fault_summary, case, n_faults, min_losses=RUN["steps"]):
    fired = run.log.count("event=fault_injected")
    cmp = compare(run, ref)
    fault_summary(f"pipeline_{case}", fired, "recovered exactly" if cmp.bit_exact else "silently wrong")
    assert fired == n_faults, run.log[-3000:]
    # every stage reports the loss sequence; all of it unless a global rollback lost the part before its window
    assert cmp.bit_exact and cmp.compared_losses >= len(ref.states) * min_losses, cmp.mismatches[:10]
    return run.report["recoveries"], [s["replayed_iterations"] for s in run.report["stages"]]


def test_kill_middle_stage_pp3(tmp_path, reference, fault_summary):
    run = run_pp(tmp_path, spec(tmp_path, 3), "kill:point=forward:rank=1:step=8", restarts=1)
    recs, replayed = check(run, reference(3), fault_summary, "kill_middle_pp3", 1)
    assert [r["plan"]["mode"] for r in recs] == ["local"], recs
    assert [(s["first"], s["last"]) for s in recs[0]["plan"]["segments"]] == [(1, 1)]
    assert replayed[0] == 0 and replayed[2] == 0 and replayed[1] > 0, replayed  # healthy stages: no recompute
    roles = [s["role"] for s in recs[0]["stages"]]
    assert roles == ["healthy", "recovered", "healthy"], roles
    assert run.report["log_bytes_per_iteration"] > 0


@pytest.mark.matrix  # PP=2 is covered by test_failure_inside_recovery
def test_kill_stage_pp2_gpipe(tmp_path, reference, fault_summary):
    run = run_pp(tmp_path, spec(tmp_path, 2, "gpipe"), "kill:point=backward:rank=0:step=7", restarts=1)
    recs, replayed = check(run, reference(2, "gpipe"), fault_summary, "kill_stage0_pp2", 1)
    assert recs[0]["plan"]["mode"] == "local" and replayed == [replayed[0], 0] and replayed[0] > 0, (recs, replayed)


def test_two_adjacent_stages_joint(tmp_path, reference, fault_summary):
    faults = "kill:point=forward:rank=1:step=8;kill:point=forward:rank=2:step=8"
    run = run_pp(tmp_path, spec(tmp_path, 3), faults, restarts=1)
    recs, replayed = check(run, reference(3), fault_summary, "two_adjacent", 2)
    assert [(s["first"], s["last"]) for s in recs[-1]["plan"]["segments"]] == [(1, 2)], recs
    assert replayed[0] == 0 and replayed[1] > 0 and replayed[2] > 0, replayed


@pytest.mark.matrix
def test_disjoint_stages_independent(tmp_path, reference, fault_summary):
    faults = "kill:point=optimizer:rank=0:step=7;kill:point=optimizer:rank=2:step=7"
    run = run_pp(tmp_path, spec(tmp_path, 3), faults, restarts=1)
    recs, replayed = check(run, reference(3), fault_summary, "disjoint", 2)
    assert [(s["first"], s["last"]) for s in recs[-1]["plan"]["segments"]] == [(0, 0), (2, 2)], recs
    assert replayed[1] == 0 and replayed[0] > 0 and replayed[2] > 0, replayed


def test_failure_inside_recovery(tmp_path, reference, fault_summary):
    # PP=2 (one process fewer per attempt, three attempts): the last stage dies, then dies again half-way
    # through its replay; the next attempt restarts its recovery, stage 0 never recomputes
    faults = "kill:point=forward:rank=1:step=8;kill:point=recovery:rank=1"
    run = run_pp(tmp_path, spec(tmp_path, 2, "gpipe"), faults, restarts=2)
    recs, replayed = check(run, reference(2, "gpipe"), fault_summary, "failure_inside_recovery", 2)
    plans = run.report["recovery_plans"]
    segs = [[(s["first"], s["last"]) for s in p["plan"]["segments"]] for p in plans]
    assert segs == [[(1, 1)], [(1, 1)]] and len(recs) == 1, plans  # the interrupted recovery restarted
    assert replayed[0] == 0 and replayed[1] > 0, replayed


@pytest.mark.matrix  # a failure during recovery: test_failure_inside_recovery
def test_neighbour_fails_during_recovery_widens(tmp_path, reference, fault_summary):
    # stage 2 is healthy and waiting while stage 1 recovers when it is killed: the segment grows to 1..2
    faults = "kill:point=forward:rank=1:step=8;kill:point=recovery:rank=2"
    run = run_pp(tmp_path, spec(tmp_path, 3), faults, restarts=2)
    recs, replayed = check(run, reference(3), fault_summary, "widened_segment", 2)
    segs = [[(s["first"], s["last"]) for s in p["plan"]["segments"]] for p in run.report["recovery_plans"]]
    assert segs == [[(1, 1)], [(1, 2)]] and len(recs) == 1, segs
    assert replayed[0] == 0, replayed


@pytest.mark.matrix  # the planner's fallbacks: test_pipeline_units.py; under TorchTitan: test_titan_pipeline.py
def test_no_live_neighbour_global(tmp_path, reference, fault_summary):
    faults = ";".join(f"kill:point=forward:rank={r}:step=8" for r in range(3))
    run = run_pp(tmp_path, spec(tmp_path, 3), faults, restarts=1)
    recs, _ = check(run, reference(3), fault_summary, "no_live_neighbour", 3, min_losses=RUN["steps"] - 4)
    assert recs[-1]["plan"]["mode"] == "global" and "no live neighbour" in recs[-1]["plan"]["reason"], recs
    assert "event=pp_recovery mode=global" in run.log


@pytest.mark.matrix
def test_log_bound_hit_falls_back_to_global(tmp_path, reference, fault_summary):
    s = spec(tmp_path, 3, log_max_bytes=40_000)  # ~2.5 iterations of stage 1's log: overflows mid-window
    run = run_pp(tmp_path, s, "kill:point=forward:rank=1:step=8", restarts=1)
    recs, replayed = check(run, reference(3), fault_summary, "log_bound_global", 1, min_losses=RUN["steps"])
    assert "event=pp_log_overflow" in run.log
    assert recs[-1]["plan"]["mode"] == "global" and "log" in recs[-1]["plan"]["reason"], recs
    assert all(r > 0 for r in replayed), replayed  # a global rollback recomputes on every stage


def test_gpipe_and_1f1b_identical(reference):
    """Both schedules run forwards and backwards in micro-batch order, so gradients accumulate in the same
    order: the fault-free runs agree bit for bit (and a replay may use either order)."""
    cmp = compare(reference(3, "gpipe"), reference(3))
    assert cmp.bit_exact and cmp.compared_losses == 3 * RUN["steps"], cmp.mismatches[:5]
