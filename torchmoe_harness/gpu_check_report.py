"""gpu_check.md: the GPU check's report (gpu_check.py) as a person reads it, one section per phase."""

from __future__ import annotations


def _gb(x) -> str:
    return "-" if x is None else f"{x / 1e9:.1f} GB"


def _environment(r: dict) -> list[str]:
    mem = r.get("host_memory_bytes", {})
    shm = r.get("dev_shm_bytes", {})
    lines = [
        f"- Python {r['python']}, torch {r['torch']} (CUDA {r['torch_cuda']}), {r['platform']}",
        f"- device: {r.get('gpu', 'none')} ({_gb(r.get('gpu_memory_bytes'))}, capability {r.get('capability', '-')}, "
        f"NCCL {r.get('nccl', '-')}); {r['cpus']} CPUs, host memory {_gb(mem.get('MemTotal'))} "
        f"({_gb(mem.get('MemAvailable'))} available), /dev/shm {_gb(shm.get('free'))} free",
        "- packages: " + ", ".join(f"{k} {v or 'missing'}" for k, v in r["packages"].items()),
        "- APIs: " + ", ".join(f"{k} {'yes' if v else 'no'}" for k, v in r["apis"].items()),
        f"- imports: {r['imports']['imported']} modules of torchmoe_ckpt and torchmoe_harness imported; "
        f"{len(r['imports']['optional_missing'])} need optional packages not here "
        f"({', '.join(sorted(r['imports']['optional_missing'])) or 'none'})",
    ]
    lines += [f"- IMPORT FAILED: {m}: {e}" for m, e in r["imports"]["failed"].items()]
    return lines


def _exact(r: dict) -> list[str]:
    lines = [
        f"- kills (kill -9): `{r['kills']}`",
        f"- bit-exact: **{r.get('bit_exact')}** over {r.get('compared_tensors', 0)} tensors (RNG states: "
        f"{', '.join(r.get('rng_states_compared', [])) or 'none'}) and {r.get('compared_losses', 0)} losses after "
        "the last recovery, against a run of the same loop without the checkpointer",
    ]
    if r.get("mismatches"):
        lines.append(f"- mismatches: {', '.join(r['mismatches'][:8])}")
    for rec in r.get("recoveries", []):
        lines.append(
            f"- attempt {rec['attempt']}: recovered window {rec.get('window')} (steps {rec.get('start_step')}.."
            f"{rec.get('recovered_step')}, {rec.get('replayed_iterations')} replayed, from {rec.get('source')}) in "
            f"{(rec.get('resume_s') or 0):.2f} s; replay exact: {rec.get('exact')}"
        )
    s = r.get("syncs", {})
    if s.get("enabled"):
        lines.append(
            f"- host syncs on the training thread per iteration (steps {s['steps'][0]}-{s['steps'][-1]}): "
            f"{s['plain_per_iteration']:.2f} without the checkpointer, {s['checkpointed_per_iteration']:.2f} with it: "
            f"**{s['added_per_iteration']:+.2f} added** (iterations with added syncs: "
            f"{s['iterations_with_added_syncs'] or 'none'}; window starts: {s.get('window_starts')})"
        )
        sites = s.get("ours", {}).get("sites", {})
        if sites:
            lines.append("- sync sites with the checkpointer: " + ", ".join(f"`{k}` x{v}" for k, v in sites.items()))
    else:
        lines.append("- host syncs: not counted (CUDA's sync debug mode needs a GPU)")
    if r.get("training_thread_wait_s"):
        w = r["training_thread_wait_s"]
        lines.append(
            f"- training-thread waits for slot copies: mean {w['mean'] * 1e3:.2f} ms, max {w['max'] * 1e3:.2f} ms"
        )
    return lines


def _nondeterministic(r: dict) -> list[str]:
    e, t = r["exact"], r["tolerant"]
    when = (
        f" {e['seconds_since_process_start']:.1f} s after its process started"
        if e.get("seconds_since_process_start")
        else ""
    )
    lines = [
        f'- `replay_check="exact"`: refused: **{e["refused"]}** (at {e.get("where")}{when}; one line: {e["one_line"]})',
        f"  > {(e.get('line') or '')[:400]}",
        f'- `replay_check="tolerant"`: recovered: **{t["recovered"]}** to step {t.get("recovered_step")} '
        f"({t.get('replayed_iterations')} replayed); replay exact: {t.get('replay_exact')}; deviation: loss "
        f"{t.get('max_loss_deviation')}, gradient norm {t.get('max_grad_norm_deviation')} "
        f"(bound {t.get('replay_tolerance')})",
        f"- non-determinism seen in the replay: {r.get('nondeterminism_seen')}",
    ]
    if t.get("refused"):
        lines.insert(3, f"  > refused: {t['refused'][:400]}")
    return lines


def _ms3(xs) -> str:
    return "-" if not xs else " / ".join(f"{x * 1e3:+.1f}" for x in xs)


def ablations(r: dict) -> list[str]:
    """Phase 3's turns one by one: what each isolates, its overhead's spread over repetitions, its copies; the
    turns this tree could not run, each with its one line."""
    from torchmoe_harness.gpu_check_bench import WHAT

    none = r["systems"].get("none", {}).get("step_s_device")
    lines = [
        "Turns (overhead per iteration on the device, paired with the same repetition's `none`, min / median / max "
        "over repetitions of whole windows; the order rotated each repetition):",
        "",
        "| turn | isolates | switches | overhead ms | of the step | blocked/iter | per copy | syncs added |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, row in r["systems"].items():
        sw = ", ".join(f"{k}={v}" for k, v in (r.get("switches", {}).get(name) or {}).items()) or "-"
        frac = row.get("overhead_s_device")
        of = "-" if frac is None or not none else f"{frac / none:+.1%}"
        copy = "-"
        if row.get("copy_s_per_copy") is not None:
            copy = f"{row['copy_s_per_copy'] * 1e3:.1f} ms, {row['copy_bytes_per_copy'] / 1e9:.2f} GB"
        syncs = row.get("added_syncs_per_iteration")
        lines.append(
            f"| {name} | {WHAT.get(name, '')} | {sw} | {_ms3(row.get('overhead_s_device_spread'))} | {of} | "
            f"{row['blocked_s_per_iteration'] * 1e3:.2f} ms | {copy} | {'-' if syncs is None else f'{syncs:+.2f}'} |"
        )
    for name, why in (r.get("skipped_turns") or {}).items():
        lines.append(f"| {name} | {WHAT.get(name, '')} | skipped: {why} | | | | | |")
    lines += [
        "",
        "Host memory after each turn's release (max over its turns): the system dropped, pinned blocks "
        "handed back unless the next turn has the same footprint:",
        "",
        "| turn | turn s (median) | RSS | pinned held |",
        "|---|---|---|---|",
    ]
    for name, row in r["systems"].items():
        lines.append(
            f"| {name} | {row.get('turn_s_median', 0):.1f} | {_gb(row.get('after_release_rss_bytes_max'))} | "
            f"{_gb(row.get('after_release_pinned_held_bytes_max'))} |"
        )
    return lines + [""]


def _bench(r: dict) -> list[str]:
    from torchmoe_harness.gpu_check_bench import markdown as bench_table
    from torchmoe_harness.gpu_check_profile import markdown as profile_summary
    from torchmoe_harness.gpu_check_slots import markdown as slot_table

    lines = []
    if r.get("partial"):
        lines += [f"**Partial**: the worker did not finish ({r['partial']}); the turns it finished are below.", ""]
    for name, row in (r.get("regimes") or {"stress": r}).items():
        one = {**r, **row}
        none = row["systems"].get("none", {}).get("step_s_device")
        ratio = one["dense_bytes"] / (none * one["pinned_copy_peak_bytes_per_s"]) if none else float("nan")
        auto = {n: max(x["windows_W"]) for n, x in row["systems"].items() if x.get("windows_W") and "auto" in n}
        lines += [
            f"### Regime {name}: {row.get('micro_batches', 1)} micro-batch(es) per step, `none` step "
            f"{(none or 0) * 1e3:.1f} ms; dense state / (step x copy peak) = {ratio:.2f}",
            "",
            "Auto W chose: " + (", ".join(f"{n} W = {w}" for n, w in auto.items()) or "-") + ".",
            "",
        ]
        lines += bench_table(one) + [""] + ablations(one) + slot_table(one.get("slots") or {})
    return lines + profile_summary(r.get("profile"))


def markdown(report: dict) -> list[str]:
    from torchmoe_harness.gpu_copy_engine import markdown as copy_engine_table

    verdict = "PASSED" if report.get("ok") else "FAILED"
    lines = [
        f"# GPU check: {verdict}",
        "",
        f"`{report['command']}` on {report['device']}{' (tiny)' if report['tiny'] else ''}, "
        f"started {report['started']}, {report.get('seconds', 0)} s so far.",
        "",
    ]
    sections = {
        "0_environment": _environment,
        "1_exact_recovery": _exact,
        "2_nondeterministic": _nondeterministic,
        "3_bench": _bench,
        "4_copy_engine": copy_engine_table,
    }
    for name, entry in report["phases"].items():
        lines += [f"## Phase {name}: {entry['status']} ({entry['seconds']} s of {entry['budget_s']} s)", ""]
        if entry["status"] == "error":
            lines += ["```", entry.get("error", ""), entry.get("traceback", ""), "```"]
        else:
            lines += sections[name](entry["result"])
            for job, j in (entry["result"].get("jobs") or {}).items():
                lines.append(f"- job {job}: {'ok' if j['ok'] else 'FAILED'} in {j['seconds']} s")
                expected = name == "2_nondeterministic" and job == "exact"  # a refusal ends that job
                if not j["ok"] and j.get("log_tail") and not expected:
                    lines += ["```", j["log_tail"][-1200:], "```"]
        lines.append("")
    return lines
