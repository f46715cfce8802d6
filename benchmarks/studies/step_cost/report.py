"""step_cost.py's report: the ratios of one configuration, the headline, and the markdown."""

from __future__ import annotations

from harness import fmt, machine_line, md_table

from .design import STEP_KINDS


def config_ratios(t: dict, mem: dict | None) -> dict:
    """Every ratio of one configuration, from the medians ``t`` and the peaks ``mem`` (NaN where not measured)."""
    def div(a, b):
        x, y = a if isinstance(a, float) else t.get(a, float("nan")), t.get(b, float("nan"))
        return x / y if y == y and y else float("nan")

    r = dict(norms_vs_fwdbwd=div("norms", "fwdbwd"), group_vs_fwdbwd=div("group", "fwdbwd"),
             norms_vs_loop=div("loop", "norms"), group_vs_loop=div("loop", "group"),
             norms_vs_loop_sq=div("loop_sq", "norms"),
             update_vs_grpo=div("update", "fwdbwd"), update_group_vs_grpo=div("update_group", "fwdbwd"),
             update_one_backward_vs_grpo=div("update_one_backward", "fwdbwd"),
             update_group_ckpt_vs_grpo_ckpt=div("update_group_ckpt", "fwdbwd_ckpt"),
             update_one_backward_vs_grpo_ckpt=div("update_one_backward", "fwdbwd_ckpt"),
             update_one_backward_ckpt_vs_grpo_ckpt=div("update_one_backward_ckpt", "fwdbwd_ckpt"))
    if mem:
        def m(a, b):
            x, y = (mem.get(a) or {}).get("peak_bytes", float("nan")), (mem.get(b) or {}).get("peak_bytes",
                                                                                             float("nan"))
            return x / y if y == y and y else float("nan")
        two, two_ckpt = ("update_group", "update_group_ckpt") if "update_group" in mem else ("group", "group_ckpt")
        r.update(peak_mem_norms_vs_grpo=m("norms", "fwdbwd"), peak_mem_group_vs_grpo=m("group", "fwdbwd"),
                 peak_mem_two_pass_vs_grpo=m(two, "fwdbwd"),
                 peak_mem_one_backward_vs_grpo=m("update_one_backward", "fwdbwd"),
                 peak_mem_two_pass_ckpt_vs_grpo_ckpt=m(two_ckpt, "fwdbwd_ckpt"),
                 peak_mem_one_backward_ckpt_vs_grpo_ckpt=m("update_one_backward_ckpt", "fwdbwd_ckpt"),
                 peak_mem_one_backward_vs_grpo_ckpt=m("update_one_backward", "fwdbwd_ckpt"))
        if two == "group":  # CPU: the two-pass update's peak is the larger of its two passes'
            peak = max(mem.get("group", {}).get("peak_bytes", float("nan")), mem["fwdbwd"]["peak_bytes"])
            r["peak_mem_two_pass_vs_grpo"] = peak / mem["fwdbwd"]["peak_bytes"]
    return r

def headline(row: dict, step: dict | None, default: str) -> list[tuple[str, float, str]]:
    """(key, value, where) of the JSON last line: the default mode's ratios under the historical keys, then each
    mode's under its own."""
    r, at = row["ratios"], f"{row['size']}, C={row['completion']}"
    s = step or {}
    st = f"{s.get('size')}, C={s.get('completion')}, whole RL step" if step else "n/a"
    two = dict(update=r["update_group_vs_grpo"] if r["update_group_vs_grpo"] == r["update_group_vs_grpo"]
               else r["update_vs_grpo"], mem=r.get("peak_mem_two_pass_vs_grpo", float("nan")),
               mem_ckpt=r.get("peak_mem_two_pass_ckpt_vs_grpo_ckpt", float("nan")),
               step=s.get("step_two_pass_vs_grpo", float("nan")))
    one = dict(update=r["update_one_backward_vs_grpo"], mem=r.get("peak_mem_one_backward_vs_grpo", float("nan")),
               mem_ckpt=r.get("peak_mem_one_backward_ckpt_vs_grpo_ckpt", float("nan")),
               step=s.get("step_one_backward_vs_grpo", float("nan")))
    d = one if default == "one_backward" else two
    auto = s.get("default", {})  # the trainer as users get it (one_backward=None), where measured
    auto_st = f"{s.get('size')}, C={s.get('completion')}, whole RL step, OBLRPOConfig defaults (one_backward=None)"
    return [
        ("default_mode", default, "the mode the historical keys below report (--default-mode)"),
        ("norms_vs_fwdbwd", r["norms_vs_fwdbwd"], at + ", per_sequence_grad_sq_norms / GRPO's forward+backward"),
        ("norms_vs_loop", r["norms_vs_loop"], at + ", naive per-sequence loop / per_sequence_grad_sq_norms"),
        ("update_vs_grpo", d["update"], at + f", the {default} update / GRPO's forward+backward"),
        ("peak_mem_vs_grpo", d["mem"], at + f", the {default} update vs GRPO's forward+backward, no checkpointing"),
        ("peak_mem_ckpt_vs_grpo_ckpt", d["mem_ckpt"], at + f", the {default} update vs GRPO's forward+backward, "
         "both under gradient checkpointing"),
        ("step_vs_grpo", d["step"], st + f", OBLRPOTrainer ({default}) / GRPOTrainer, TRL defaults"),
        ("update_two_pass_vs_grpo", two["update"], at + ", group norms pass + loss pass (two passes)"),
        ("update_one_backward_vs_grpo", one["update"], at + ", OBLRPOConfig(one_backward=True)'s update"),
        ("peak_mem_two_pass_vs_grpo", two["mem"], at + ", two passes, no checkpointing"),
        ("peak_mem_one_backward_vs_grpo", one["mem"], at + ", one_backward, no checkpointing"),
        ("peak_mem_two_pass_ckpt_vs_grpo_ckpt", two["mem_ckpt"], at + ", two passes, both checkpointed"),
        ("peak_mem_one_backward_ckpt_vs_grpo_ckpt", one["mem_ckpt"], at + ", one_backward, both checkpointed"),
        ("step_two_pass_vs_grpo", two["step"], st + ", two passes"),
        ("step_one_backward_vs_grpo", one["step"], st + ", one_backward"),
        ("step_peak_mem_vs_grpo", s.get(f"step_peak_mem_{default}_vs_grpo", float("nan")),
         st + f", peak RSS of the {default} trainer's process / GRPOTrainer's (checkpointed)"),
        ("step_default_vs_grpo", s.get("step_default_vs_grpo", float("nan")),
         auto_st + f" / GRPOTrainer, both checkpointed; it took {auto.get('mode', 'n/a')}"),
        ("step_peak_mem_default_vs_grpo", s.get("step_peak_mem_default_vs_grpo", float("nan")),
         auto_st + ", peak RSS / GRPOTrainer's, both checkpointed"),
        ("step_default_no_ckpt_vs_grpo_no_ckpt", s.get("step_default_no_ckpt_vs_grpo", float("nan")),
         auto_st.replace("defaults", "defaults without checkpointing") + " / GRPOTrainer without checkpointing; it took "
         + s.get("default_no_ckpt", {}).get("mode", "n/a")),
        ("step_peak_mem_default_no_ckpt_vs_grpo_no_ckpt", s.get("step_peak_mem_default_no_ckpt_vs_grpo", float("nan")),
         auto_st.replace("defaults", "defaults without checkpointing") + ", peak RSS / GRPOTrainer's, neither "
         "checkpointed"),
    ]

def render_markdown(res: dict) -> str:
    m, a = res["machine"], res["args"]
    out = [f"# OBLR-PO step cost ({'quick' if a['quick'] else 'full'} run)", "",
           f"Generated by `{res['command'].strip()}` on {m['date']}.", machine_line(m),
           f"Batch {a['batch']} sequences of {a['prompt_len']} prompt + C completion tokens (random ids, 2 left-padded "
           f"prompts, 3 completions ending early), group size {a['group']}; median of {a['repeats']} interleaved "
           f"rounds after a warm-up round. Run time {res['elapsed_s']:.0f}s. Default mode (the historical keys): "
           f"**{a['default_mode']}**.", "", "## Headline", ""]
    out += md_table(["ratio", "value", "taken at"],
                    [[f"`{k}`", v if isinstance(v, str) else fmt(v), res["headline_where"][k]]
                     for k, v in res["headline"].items()])
    out += ["", "## Update: GRPO vs two passes vs one_backward, per configuration", "",
            "Times in seconds. `GRPO`: its loss pass (fused LM head, sum of completion log-probs, backward). "
            "`norms`: `per_sequence_grad_sq_norms`; `group`: `per_sequence_grad_inner_products(group_size=8)`; "
            "`loop`: one forward+backward per sequence (the naive peer). `two-pass`: the group norms pass then GRPO's "
            "loss pass, timed together; `one_backward`: `OBLRPOConfig(one_backward=True)`'s update. `ckpt`: under "
            "gradient checkpointing (TRL's default). Ratios are to GRPO's pass under the same checkpointing setting "
            "unless marked. Peak memory: " + _mem_method(res) + ".", ""]
    rows = []
    for r in res["rows"]:
        t, q, mem = r["times"], r["ratios"], r.get("memory") or {}
        mb = lambda k: fmt((mem.get(k) or {}).get("peak_bytes", float("nan")) / 2**20, ".0f")  # noqa: E731
        rows.append([f"{r['size']} (d={r['hidden']}, {r['layers']}L, V={r['vocab']})", f"{r['params'] / 1e6:.1f}M",
                     r["completion"], fmt(t.get("fwdbwd"), ".3f"), fmt(t.get("fwdbwd_ckpt"), ".3f"),
                     fmt(t.get("norms"), ".3f"), fmt(t.get("group"), ".3f"), fmt(t.get("loop"), ".3f"),
                     f"**{fmt(q['norms_vs_fwdbwd'])}**", f"**{fmt(q['norms_vs_loop'])}**",
                     fmt(q["update_group_vs_grpo"]), fmt(q["update_one_backward_vs_grpo"]),
                     fmt(q["update_group_ckpt_vs_grpo_ckpt"]), fmt(q["update_one_backward_ckpt_vs_grpo_ckpt"]),
                     mb("fwdbwd"), mb("fwdbwd_ckpt"), fmt(q.get("peak_mem_two_pass_vs_grpo")),
                     fmt(q.get("peak_mem_one_backward_vs_grpo")), fmt(q.get("peak_mem_two_pass_ckpt_vs_grpo_ckpt")),
                     fmt(q.get("peak_mem_one_backward_ckpt_vs_grpo_ckpt")),
                     fmt(r["max_rel_err_norms"], ".1e") + (" " + "; ".join(r["skipped"]) if r["skipped"] else "")])
    out += md_table(["model", "params", "C", "GRPO s", "GRPO ckpt s", "norms s", "group s", "loop s", "norms/GRPO",
                     "loop/norms", "time two-pass/GRPO", "time one_backward/GRPO", "time two-pass/GRPO, ckpt",
                     "time one_backward/GRPO, ckpt", "GRPO peak MB", "GRPO ckpt peak MB", "mem two-pass/GRPO",
                     "mem one_backward/GRPO", "mem two-pass/GRPO, ckpt", "mem one_backward/GRPO, ckpt",
                     "max rel err (norms vs loop); notes"], rows)
    if res["steps"]:
        out += ["", "## Whole RL step (generation included)", "",
                "`trl.GRPOTrainer` + `GRPOConfig` vs `OBLRPOTrainer` + `OBLRPOConfig` in each mode, same arguments "
                f"otherwise (per_device_train_batch_size {a['step_batch']}, num_generations {a['group']}, reward = "
                "count of '1', completions forced to exactly C tokens with `min_new_tokens`, TRL's defaults incl. "
                "gradient checkpointing unless `no_ckpt`). `default` is `OBLRPOConfig`'s `one_backward=None` (the "
                "automatic choice; 'mode taken' says which path it chose); ratios are to the GRPO step with the same "
                "checkpointing setting (`grpo_no_ckpt`'s to `grpo`'s). Each trainer runs in its own process, one after the "
                "other; median wall time of a step (`on_step_begin`..`on_step_end`) after one warm-up step; peak "
                "memory: peak RSS of the process above its RSS before `train()` (CPU).", ""]
        rows = []
        for s in res["steps"]:
            for kind in STEP_KINDS:
                k = s.get(kind)
                if not k:
                    continue
                if "failed" in k:
                    rows.append([s["size"], s["completion"], kind, "failed", "", "", "", "", "", ""])
                    continue
                rows.append([s["size"], s["completion"], kind, k.get("mode", ""), k["gradient_checkpointing"],
                             f"{k['step_s']:.2f}",
                             fmt(k["sections"].get("generate+score"), ".2f"), f"{k['peak_bytes'] / 2**20:.0f}",
                             "1.00" if kind == "grpo" else f"**{fmt(s.get(f'step_{kind}_vs_grpo'))}**",
                             "1.00" if kind == "grpo" else fmt(s.get(f"step_peak_mem_{kind}_vs_grpo"))])
        out += md_table(["model", "C", "trainer", "mode taken", "checkpointing", "step s", "generate+score s",
                         "peak MB", "step / GRPO", "peak mem / GRPO"], rows)
    profiled = [r for r in res["rows"] if r.get("profile")]
    for r in profiled:
        prof = r["profile"]
        pb, la = prof["plain_backbone"], prof["linear_alternatives"]
        out += ["", f"## Where the norms pass spends its time: {r['size']}, C={r['completion']}", "",
                "One call of each form under `torch.profiler` (operators by self time; the call's wall time "
                "includes the profiler's overhead). Plain backbone (no hooks): forward "
                f"{pb['forward']:.3f}s, backward to the weights {pb['backward']:.3f}s, backward to the embedding "
                f"output only {pb['backward_inputs_only']:.3f}s. Linear layers' share of the inner products, token "
                f"Grams vs materialized per-sequence gradients: sq form {la['gram_sq']:.3f}s vs "
                f"{la['materialize_sq']:.3f}s; group form {la['gram_group']:.3f}s vs {la['materialize_group']:.3f}s.",
                ""]
        for form in ("norms", "group"):
            if form in prof:
                p = prof[form]
                out += [f"`{form}` ({p['total']:.3f}s wall):", ""]
                out += md_table(["operator", "self s", "share of profiled"],
                                [[f"`{k}`", f"{v:.3f}", f"{100 * v / p['profiled_total']:.0f}%"]
                                 for k, v in p["ops"].items()]) + [""]
    out.append("")
    return "\n".join(out)

def _mem_method(res) -> str:
    for r in res["rows"]:
        for v in (r.get("memory") or {}).values():
            if "method" in v and not v["method"].startswith("failed"):
                where = ", ".join(f"{x['size']} C={x['completion']}" for x in res["rows"] if x.get("memory"))
                extra = (", one fresh subprocess per measurement, after building the model and batch and a short "
                         "warm-up call" if "RSS" in v["method"] else "")
                return v["method"] + extra + "; measured at " + where
    return "not measured"
