"""Human-readable output: byte formatting and the planner's tables (rich)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from rich import box
from rich.console import Console
from rich.table import Table

from kvlab.plan import Plan
from kvlab.units import fmt_bytes, fmt_count, fmt_flops, fmt_iec, fmt_seconds, plural

if TYPE_CHECKING:
    from kvlab.bench import BenchResult
    from kvlab.demo import DemoReport
    from kvlab.measure import Measurement


def _table(title: str) -> Table:
    t = Table(title=title, title_justify="left", show_header=False, box=None, pad_edge=False)
    t.add_column(style="bold")
    t.add_column(justify="right")
    t.add_column(style="dim")
    return t


def print_plan(p: Plan, console: Console | None = None) -> None:
    c = console or Console(width=max(Console().width, 110))
    on = "this machine's CPU" if p.gpu == "cpu" else f"{p.gpus} x {p.gpu} (TP {p.tp})"
    c.print(f"[bold]{p.model}[/]  context {p.context:,} tokens x {plural(p.users, 'user')}, KV {p.kv_dtype}, "
            f"weights {p.weights_dtype}, {on}")
    t = _table("KV cache")
    t.add_row("per token", f"{p.kv_bytes_per_token:,} B", fmt_bytes(p.kv_bytes_per_token))
    if p.kv_bytes_per_token_without_gqa:
        ratio = p.kv_bytes_per_token_without_gqa / p.kv_bytes_per_token
        t.add_row("per token without GQA", f"{p.kv_bytes_per_token_without_gqa:,} B", f"{ratio:.1f}x more")
    t.add_row(f"per sequence ({p.context:,} tokens)", fmt_bytes(p.kv_bytes_per_sequence), "")
    if p.users > 1:
        t.add_row(f"all {p.users:,} sequences", fmt_bytes(p.kv_bytes_total), "")
    if p.gpu != "cpu":
        t.add_row(f"one sequence per GPU (TP {p.tp})", fmt_bytes(p.kv_bytes_per_gpu), p.kv_split)
    t.add_row("dtype layout", p.kv_layout, "")
    c.print(t)
    lt = Table(title="By layer kind", title_justify="left")
    for col in ("kind", "layers", "bytes / token", f"per sequence at {p.context:,}"):
        lt.add_column(col, justify="right" if col != "kind" else "left")
    for row in p.layer_breakdown:
        lt.add_row(row["kind"], str(row["layers"]), f"{row['bytes_per_token']:,}", fmt_bytes(row["bytes_per_sequence"]))
    c.print(lt)

    t = _table("Memory")
    held = "" if p.weights_held_by_kvlab else "linear layers in "  # its label names every tensor's format
    t.add_row("weights", fmt_bytes(p.weights_bytes),
              f"{fmt_count(p.num_params)} params ({fmt_count(p.active_params)} active per token), "
              f"{held}{p.weights_dtype} ({p.weights_dtype_why})")
    if p.stored_weights_bytes is not None:
        kept = (f"kvlab's engine runs {p.stored_weights_as_stored} as stored on the CPU, dequantises the rest "
                f"(on a GPU, all) to the model's dtype" if p.stored_weights_as_stored
                else "kvlab's engine dequantises them to the model's dtype as it loads")
        t.add_row("weights as stored in the file", fmt_bytes(p.stored_weights_bytes),
                  f"{p.stored_weights_formats}; {kept}")
    t.add_row("logits, all prompt positions", fmt_bytes(p.logits_bytes_all_positions),
              f"{p.logits_bytes_all_positions / max(1, p.kv_bytes_per_sequence):.1f}x this sequence's KV")
    t.add_row("logits, last position only", fmt_bytes(p.logits_bytes_last_only), "what generation needs")
    t.add_row("activations (allowance)", fmt_bytes(p.activation_allowance_bytes), "estimate")
    t.add_row("runtime overhead (allowance)", fmt_bytes(p.runtime_overhead_bytes), "estimate")
    c.print(t)

    t = _table(f"On {p.gpu_name} ({fmt_bytes(p.gpu_memory_bytes)}, {p.usable_bytes_per_gpu / p.gpu_memory_bytes:.0%} usable)")
    cpu = p.gpu == "cpu"
    where = "this machine" if cpu else f"{p.gpus} GPU{'s' if p.gpus > 1 else ''}"
    budget, taken = ("KV budget", "weights") if cpu else ("KV budget per GPU", "weights/TP")
    if p.memory_shortfall_bytes_per_gpu:  # never a negative budget: what is missing instead
        t.add_row(budget, "none", f"{taken} and allowances exceed the usable memory by "
                  f"{fmt_bytes(p.memory_shortfall_bytes_per_gpu)}")
    else:
        t.add_row(budget, fmt_bytes(p.kv_budget_bytes_per_gpu), f"after {taken} and allowances")
    t.add_row(f"sequences of {p.context:,} tokens that fit", f"{p.max_sequences:,}", f"on {where}")
    longest = f"longest context for {plural(p.users, 'user')}"
    if p.max_context_for_users:
        t.add_row(longest, f"{p.max_context_for_users:,}", "tokens")
    else:
        t.add_row(longest, "does not fit", "not even 1 token each")
    if not cpu:
        t.add_row("GPUs needed (everything)", str(p.gpus_needed) if p.gpus_needed else "> 4096", "")
        t.add_row("GPUs for the cache alone", str(p.gpus_needed_cache_only), "")
        t.add_row("valid TP sizes", ", ".join(map(str, p.valid_tp_sizes)), "")
    if p.dp_attention:
        t.add_row("cache of the batch per GPU", fmt_bytes(p.kv_bytes_batch_per_gpu),
                  f"DP attention: each of the {p.tp} TP ranks holds whole caches of its share")
    c.print(t)

    t = _table("Speed bounds: each step takes the longer of bytes / bandwidth and FLOPs / peak")
    t.add_row("peak compute", f"{p.device_flops / 1e9:,.0f} GFLOP/s", p.device_flops_why)
    reads = p.decode_weights_seconds + p.decode_kv_seconds
    limit = "compute-bound" if p.decode_compute_seconds > reads else "memory-bound"
    t.add_row("decode step", fmt_seconds(p.decode_step_seconds),
              f"reads {fmt_seconds(reads)} (weights {fmt_seconds(p.decode_weights_seconds)} + cache "
              f"{fmt_seconds(p.decode_kv_seconds)}), compute {fmt_seconds(p.decode_compute_seconds)}: {limit}")
    t.add_row("decode throughput", f"{p.decode_tokens_per_s:,.0f} tok/s",
              f"upper bound; {fmt_flops(p.decode_flops_per_token)} per token at {p.context:,} tokens")
    t.add_row("decode FLOP per byte", f"{p.decode_flops_per_byte:,.1f}",
              f"compute-bound needs the device's {p.device_flops_per_byte:,.0f} (peak FLOP/s / bandwidth)")
    t.add_row("compute-bound from batch", f"{p.compute_bound_batch:,}" if p.compute_bound_batch else "never",
              "decode's FLOPs outlast its reads from this batch on" if p.compute_bound_batch
              else f"at {p.context:,} tokens each sequence's cache reads outgrow its FLOPs")
    t.add_row(f"TTFT for {p.context:,} tokens", fmt_seconds(p.ttft_seconds), fmt_flops(p.prefill_flops))
    t.add_row("crossover batch", f"{p.crossover_batch:,}" if p.crossover_batch else "never",
              "cache reads overtake weight reads from this batch on")
    c.print(t)

    wt = Table(title=f"Work with and without a cache (prompt {p.work_table[0]['prompt']}): without, "
               f"every step recomputes the whole prefix", title_justify="left")
    for col in ("new tokens", "tokens with cache", "tokens without", "ratio", "FLOPs with cache",
                "FLOPs without", "ratio"):
        wt.add_column(col, justify="right")
    for r in p.work_table:
        wt.add_row(str(r["new_tokens"]), f"{r['tokens_with_cache']:,}", f"{r['tokens_without_cache']:,}",
                   f"{r['work_ratio']:.1f}x", fmt_flops(r["flops_with_cache"]),
                   fmt_flops(r["flops_without_cache"]), f"{r['flops_ratio']:.1f}x")
    c.print(wt)
    if p.prefix_tiers:
        _print_tiers(p, c)
    if p.eviction:
        _print_eviction(p, c)
    if not (p.engine or "").startswith("vllm"):  # --engine vllm prints its own `vllm serve` line
        c.print(f"[bold]vLLM:[/] {p.vllm_flags}" if p.vllm_flags else
                f"[bold]vLLM:[/] no command: not one sequence of {p.context:,} tokens fits")
    if p.engine:
        c.print(f"[bold]{p.engine} will log:[/]")
        for line in p.engine_log_lines:
            c.print(line, markup=False, highlight=False, soft_wrap=True)
        c.print(f"[bold]with:[/] {p.engine_command}", highlight=False, soft_wrap=True)
    for note in p.notes:
        c.print(f"[yellow]note:[/] {note}")


def _print_eviction(p: Plan, c: Console) -> None:
    """--kv-policy: what a sequence keeps in kvlab's engine, the sequences that buys, and the
    accuracy measured for the policy on this model family (kvlab.plan.eviction)."""
    e = p.eviction
    assert e is not None
    t = _table(f"Eviction: --kv-policy {e.policy} --kv-budget {e.budget} in kvlab's engine")
    t.add_row(f"budget at {p.context:,} tokens", f"{e.budget_tokens:,} tokens",
              f"{e.budget_tokens / p.context:.0%} of the context")
    t.add_row("full-attention layers hold", f"{e.held_tokens_generating:,} tokens",
              f"while generating (the budget in whole blocks + the one being written); at most "
              f"{e.held_tokens_peak:,} while the prompt goes in")
    t.add_row("cache per sequence", fmt_bytes(e.bytes_per_sequence),
              f"{e.saved_fraction:.0%} less than the full cache's {fmt_bytes(e.bytes_per_sequence_full)}; "
              f"peak {fmt_bytes(e.bytes_per_sequence_peak)}")
    gain = f" ({e.max_sequences / e.max_sequences_full:.1f}x)" if e.max_sequences_full else ""
    t.add_row("sequences generating at once", f"{e.max_sequences:,}",
              f"{e.max_sequences_full:,} with the full cache{gain}, in the KV budget above")
    c.print(t)
    for note in e.notes:
        c.print(f"[yellow]note:[/] {note}")
    if not e.measured:
        return
    m = Table(title=f"Measured (kvlab evict, {e.policy} at the measured budget nearest "
              f"{e.budget_tokens / p.context:.0%}): accuracy [95% CI] beside the full cache on the same prompts",
              title_justify="left")
    for col in ("model", "task", "context", "budget", e.policy, "full", "trials / task"):
        m.add_column(col, justify="left" if col in ("model", "task") else "right")
    for r in e.measured:
        m.add_row(r.model, r.task, f"{r.context:,}", f"{r.budget:,} ({r.ratio:.0%})",
                  f"{r.accuracy:.0%} [{r.low:.0%}-{r.high:.0%}]", f"{r.full_accuracy:.0%}", str(r.trials))
    c.print(m)
    for command, cpu in dict.fromkeys((r.command, r.cpu) for r in e.measured):
        c.print(f"[dim]measured by: {command} ({cpu})[/]", highlight=False, soft_wrap=True)


def _print_tiers(p: Plan, c: Console) -> None:
    """The prefix tiers: what each holds, a token's load against its recompute, and the crossover."""
    assert p.recompute_seconds_per_token is not None
    t = Table(title=f"Prefix tiers: a hit loads K/V instead of recomputing the prefix (recompute: "
              f"{fmt_seconds(p.recompute_seconds_per_token)} a token over {p.context:,} tokens, compute-bound)",
              title_justify="left")
    for col in ("tier", "budget", "prefix tokens held", "load rate", "load / token", "vs recompute",
                "loads win from"):
        t.add_column(col, justify="left" if col == "tier" else "right")
    for tier in p.prefix_tiers:
        seqs, speedup = tier.tokens / p.context, p.recompute_seconds_per_token / tier.load_seconds_per_token
        t.add_row("RAM" if tier.tier == "ram" else "disk", fmt_iec(tier.budget_bytes),
                  f"{tier.tokens:,} ({seqs:,.1f} x {p.context:,})", f"{tier.load_bytes_per_s / 1e9:,.2f} GB/s",
                  fmt_seconds(tier.load_seconds_per_token),
                  f"{speedup:,.1f}x faster" if speedup >= 1 else f"{1 / speedup:,.1f}x slower",
                  f"{tier.crossover_tokens:,} tokens" if tier.crossover_tokens else "never")
    c.print(t)
    for tier in p.prefix_tiers:
        c.print(f"[dim]{'RAM' if tier.tier == 'ram' else 'disk'} load: {tier.load_path}[/]")


def print_models(rows: list[dict], console: Console | None = None) -> None:
    """The catalogue, one model per two lines: the short name and the Hugging Face id (for a
    model file on this machine: a note, its path follows the table, where it may wrap) each on its own line and never cut, since either is what the user types next (any
    width from 80 up)."""
    c = console or Console()
    t = Table(title="kvlab models: model files on this machine (run by short name), then the catalogue "
                    "(plan by either name); KV per token at 16-bit",
              title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False)
    t.add_column("name / Hugging Face id", no_wrap=True)
    t.add_column("params", justify="right", no_wrap=True)
    t.add_column("KV / token", justify="right", no_wrap=True)
    t.add_column("layers")
    for r in rows:
        kinds = ", ".join(f"{n} {k}" for k, n in r["layers"].items())
        second = "on this machine (path below)" if r.get("path") else r["id"]
        t.add_row(f"[bold]{r['alias']}[/]\n{second}", fmt_count(r["params"]), fmt_iec(r["kv_bytes_per_token"]),
                  f"{r['model_type']}: {kinds}")
    c.print(t)
    for r in rows:
        if r.get("path"):
            c.print(f"{r['alias']}: {r['path']}", soft_wrap=True, highlight=False)


def differing_outputs_note(same: int, total: int, dtype: str, what: str) -> str | None:
    """Why two runs that should agree token for token may not, said where the count appears.

    Both runs compute the same logits, but they add the same numbers in a different order (one
    new token against the cache vs the whole sequence; paged vs padded batches); in 16 bits the
    rounding of that order can swap two near-tied candidates, and one swapped token changes all
    that follows. In fp32 the margin dwarfs the rounding, so the outputs agree."""
    if same >= total:
        return None
    if dtype in ("bf16", "fp16"):
        return (f"{same}/{total} identical {what} is expected in {dtype}, not a bug: the two runs add the "
                f"same numbers in a different order, 16-bit rounding can swap two near-tied tokens, and "
                f"one swap changes everything after it. Check with --dtype fp32: identical.")
    return f"{same}/{total} identical {what} in {dtype}: unexpected at this precision, please report it"


def print_measurement(m: Measurement, console: Console | None = None) -> None:
    c = console or Console(width=max(Console().width, 110))
    k = m.count
    c.print(f"[bold]{m.model}[/]  cache dtype {m.dtype}")
    t = _table(f"1. Cache tensors after a {k.context:,}-token prefill")
    t.add_row("tensors", f"{k.tensors}", "shapes " + ", ".join(str(tuple(s)) for s in k.shapes))
    t.add_row("total", f"{k.total_bytes:,} B", f"formula {k.formula_bytes:,} B")
    windowed = k.formula_bytes != k.context * k.formula_bytes_per_token
    t.add_row("bytes per token", f"{k.counted_bytes_per_token:,.1f}",
              f"formula {k.formula_bytes / k.context:,.1f} at this context; {k.formula_bytes_per_token:,} "
              f"while every layer grows" if windowed else f"formula {k.formula_bytes_per_token:,}")
    if len(k.by_kind) > 1:
        for kind, (n, counted, formula) in k.by_kind.items():
            t.add_row(f"  {kind} layers", f"{counted:,} B", f"{n} tensors; formula {formula:,} B")
    c.print(t)
    s = m.slope
    st = Table(title="2. Allocated cache bytes over contexts", title_justify="left")
    for col in ("context", "allocated", "formula", "B/token since previous", "formula"):
        st.add_column(col, justify="right")
    steps = [("", "")] + [(f"{a:,.1f}", f"{f:,.1f}") for a, f in
                          zip(s.marginal_bytes_per_token, s.formula_marginal_bytes_per_token)]
    for n, a, f, (ma, mf) in zip(s.contexts, s.allocated_bytes, s.formula_bytes, steps):
        st.add_row(f"{n:,}", f"{a:,}", f"{f:,}", ma, mf)
    c.print(st)
    if len(set(s.formula_marginal_bytes_per_token)) > 1:  # windows: no single slope to fit
        c.print(f"growth bends where sliding layers reach their window: {s.marginal_bytes_per_token[0]:,.1f} "
                f"-> {s.marginal_bytes_per_token[-1]:,.1f} B/token (formula {s.formula_marginal_bytes_per_token[0]:,.1f} "
                f"-> {s.formula_marginal_bytes_per_token[-1]:,.1f})")
    else:
        c.print(f"slope {s.slope_bytes_per_token:,.1f} B/token vs formula {s.formula_bytes_per_token:,} "
                f"({s.deviation_percent:+.3f}%)")
    p = m.prefill
    t = _table(f"3. Extra memory of a {p.context:,}-token prefill (beyond the cache)")
    t.add_row("all-position logits", fmt_bytes(p.extra_all_positions),
              f"logits {fmt_bytes(p.logits_bytes_all_positions)} = {p.logits_share_percent:.1f}% of it")
    t.add_row("last-position logits only", fmt_bytes(p.extra_last_only),
              f"{p.extra_all_positions / max(1, p.extra_last_only):.1f}x less")
    t.add_row("logits / KV cache", f"{p.logits_to_kv_ratio:.1f}x", f"KV {fmt_bytes(p.kv_bytes)}")
    c.print(t)
    ct = Table(title=f"4. With vs without the cache (prompt {m.cache_vs_no_cache[0].prompt})", title_justify="left")
    for col in ("new tokens", "with cache", "without", "time ratio", "work ratio", "identical tokens"):
        ct.add_column(col, justify="right")
    for r in m.cache_vs_no_cache:
        ct.add_row(str(r.new_tokens), fmt_seconds(r.seconds_with_cache), fmt_seconds(r.seconds_without_cache),
                   f"{r.time_ratio:.2f}x", f"{r.work_ratio:.1f}x", f"{r.identical_tokens}/{r.new_tokens}")
    c.print(ct)
    worst = min(m.cache_vs_no_cache, key=lambda r: r.identical_tokens / r.new_tokens)
    note = differing_outputs_note(worst.identical_tokens, worst.new_tokens, m.dtype,
                                  "tokens with and without the cache")
    if note:
        c.print(f"[yellow]note:[/] {note}")


def print_bench(r: BenchResult, console: Console | None = None) -> None:
    c = console or Console(width=max(Console().width, 110))
    t = _table(f"kvlab bench: {r.model}, {r.num_requests} requests, {r.output_tokens:,} output tokens "
               f"in {r.seconds:,.1f} s")
    t.add_row("model dtype", r.dtype, r.dtype_why)
    matrices = ", ".join(f"{n} {kind}" for kind, n in sorted(r.held_formats.items(), key=lambda kv: -kv[1]))
    t.add_row("weights held", fmt_bytes(r.held_weight_bytes),
              f"matrices {matrices}" + (f"; {r.weights}" if r.weights else "") + "; each decode step reads them")
    if r.linear_kernel:
        t.add_row("linear layers", "", r.linear_kernel)
    if r.activations == "int8":
        t.add_row("activations", "int8", "the stored 32-weight layers' input rows quantised per 32 values: "
                  "faster, lossy (--activations fp32 is exact)")
    if r.cpu_paths:
        t.add_row("CPU paths", "", r.cpu_paths)
    if r.deterministic:
        t.add_row("mode", "deterministic", f"{r.deterministic_why}; batch-invariant kernels: a row's "
                  "results never depend on the batch")
    else:
        t.add_row("mode", "fast kernels", f"{r.deterministic_why}; a batched request may differ from "
                  "its solo run in the last bits")
    t.add_row("output tokens/s", f"{r.output_tokens_per_s:,.1f}", "")
    if r.hf_output_tokens_per_s:
        t.add_row(f"transformers (static batches of {r.hf_batch_size})", f"{r.hf_output_tokens_per_s:,.1f}",
                  f"kvlab is {r.output_tokens_per_s / r.hf_output_tokens_per_s:.2f}x; "
                  f"{r.hf_identical_requests}/{r.num_requests} identical greedy outputs")
    if r.compute_bound_tokens_per_s:
        share = f"kvlab at {r.output_tokens_per_s / r.compute_bound_tokens_per_s:.0%} of it"
        if r.hf_output_tokens_per_s:
            share += f", transformers at {r.hf_output_tokens_per_s / r.compute_bound_tokens_per_s:.0%}"
        t.add_row("compute bound (output tokens/s)", f"{r.compute_bound_tokens_per_s:,.1f}",
                  f"{fmt_flops(r.work_flops)} at the model's largest layer's measured rate "
                  f"{r.matmul_peak_flops / 1e9:,.0f} GFLOP/s; {share}")
    if r.prefill_peak_fraction is not None:
        t.add_row("prefill steps: of the matmul peak", f"{r.prefill_peak_fraction:.1%}",
                  f"{r.prefill_flops / r.prefill_seconds / 1e9:,.1f} GFLOP/s: {fmt_flops(r.prefill_flops)} "
                  f"in {fmt_seconds(r.prefill_seconds)}")
    if r.decode_peak_fraction is not None:
        bandwidth = (f"{r.decode_bandwidth_fraction:.1%}" if r.decode_bandwidth_fraction is not None
                     else "no bandwidth figure")
        reads = (f"{r.decode_bytes / r.decode_seconds / 1e9:,.2f} of {r.memory_bandwidth / 1e9:,.2f} GB/s; "
                 if r.memory_bandwidth else "")
        t.add_row("decode steps: of the bandwidth", bandwidth,
                  f"{reads}FLOP/s {r.decode_peak_fraction:.2%} of the matmul peak "
                  f"({fmt_flops(r.decode_flops)} in {fmt_seconds(r.decode_seconds)})")
    if r.decode_tokens_per_s is not None:
        t.add_row("decode tokens/s (batch 1)", f"{r.decode_tokens_per_s:,.1f}",
                  f"{r.decode_tokens_per_s / r.bound_tokens_per_s:.0%} of the bandwidth bound "
                  f"{r.bound_tokens_per_s:,.1f}" if r.bound_tokens_per_s else "")
    t.add_row("TTFT p50 / p99", f"{fmt_seconds(r.ttft_p50_s)} / {fmt_seconds(r.ttft_p99_s)}",
              f"first {fmt_seconds(r.ttft_first_s)}, mean after it {fmt_seconds(r.ttft_mean_after_first_s)}")
    t.add_row("inter-token latency p50 / p99", f"{fmt_seconds(r.itl_p50_s)} / {fmt_seconds(r.itl_p99_s)}", "")
    t.add_row("peak KV usage", f"{r.peak_kv_usage:.1%}", f"of {r.kv_cache_blocks:,} blocks")
    t.add_row("KV waste at peak", f"{r.kv_waste_at_peak:.2%}", "empty slots in allocated blocks / slots in use")
    t.add_row("prefix cache hits", f"{r.prefix_hit_rate:.1%}", f"{r.prefix_hits:,} of {r.prefix_queries:,} prompt tokens")
    t.add_row("preemptions", f"{r.preemptions}", "")
    t.add_row("sequences at once", f"{r.max_running}", f"most holding KV; {r.max_decoding} generating at once")
    c.print(t)
    notes = list(r.notes)
    if r.hf_identical_requests is not None:
        why = differing_outputs_note(r.hf_identical_requests, r.num_requests, r.dtype,
                                     "greedy outputs (kvlab vs transformers)")
        notes += [why] if why else []
    for note in notes:
        c.print(f"[yellow]note:[/] {note}")


def print_demo(d: DemoReport, console: Console | None = None) -> None:
    """The demo as four short screens: what was asked, what was reused, what had to leave and
    come back, and every cache figure beside the plan's, each in one unit (bytes, then blocks)."""
    c = console or Console(width=max(min(Console().width, 110), 80))
    o, m, p = d.options, d.metrics, d.predicted
    bs, n = o.block_size, len(d.chats)
    per_chat = -(-d.max_model_len // bs)
    c.print(f"[bold]kvlab demo[/]: the KV cache of {d.model} at work: {n} chats, greedy, "
            f"{d.steps} engine steps")
    mode = (f"deterministic ({d.deterministic_why}): batch-invariant kernels, each answer is its solo run's"
            if d.deterministic else f"fast kernels ({d.deterministic_why}): a batched answer may differ from "
            "its solo run in the last bits")
    c.print(f"  model dtype: {d.dtype}")
    c.print(f"  mode: {mode}")

    c.rule("[bold]1. What was asked", align="left")
    c.print(f"Every chat opens with the same system prompt; through the chat template that is the same "
            f"first [bold]{d.shared_tokens}[/] tokens of each prompt:")
    c.print(f"  [dim]system:[/] {d.system}")
    c.print("Then each asks its own question ([bold]prompt[/], read in one pass) and the model writes "
            "the answer ([green]continuation[/], one token per step):")
    for i, ch in enumerate(d.chats, 1):
        c.print(f"  [bold]chat {i}[/] asked ({ch.prompt_tokens} prompt tokens): [bold]{ch.question}[/]")
        c.print(f"         answered ({ch.answer_tokens} tokens): [green]{ch.answer.strip()}[/]")

    c.rule("[bold]2. What was reused: the prefix cache", align="left")
    shared_blocks = d.shared_tokens // bs
    c.print(f"The cache stores keys and values in blocks of {bs} tokens. A full block is known by a hash "
            f"of its tokens and of every token before it, so the {shared_blocks} full blocks of the shared "
            f"opening ({shared_blocks * bs} tokens) are computed once and then found by the chats that "
            f"start later (chats that start in the same step as the first compute them too); the rest "
            f"of the opening shares a block with the question and is computed anew.")
    for i, ch in enumerate(d.chats, 1):
        how = "computed them all" if not ch.cached_tokens else f"computed the other {ch.prompt_tokens - ch.cached_tokens}"
        c.print(f"  chat {i}: {ch.cached_tokens:>3} of {ch.prompt_tokens} prompt tokens from the cache, {how}")
    hits, queries = m["prefix_cache_hits"], m["prefix_cache_queries"]
    c.print(f"In all {hits:,} of {queries:,} prompt tokens ({hits / max(1, queries):.0%}) came from the "
            f"cache; at most {n - 1} x {shared_blocks * bs} = {(n - 1) * shared_blocks * bs:,} could "
            f"(every chat after the first, every shared full block).")

    c.rule("[bold]3. What had to leave and come back: preemption", align="left")
    c.print(f"The cache has {m['kv_cache_blocks']:,} blocks ({m['kv_cache_tokens']:,} tokens). A whole chat "
            f"(prompt and {d.max_model_len - max(ch.prompt_tokens for ch in d.chats)} answer tokens, "
            f"{d.max_model_len} tokens) needs up to {per_chat} blocks, so {n} chats would need "
            f"{n * per_chat} without sharing. The scheduler admits chats while blocks last; when a running "
            f"chat needs a new block and none is free, it [bold]preempts[/] the chat admitted last: that "
            f"chat leaves the cache so the others can go on, and comes back when blocks free up.")
    c.print("  [bold]swap[/] (--preemption swap-ram or swap-disk): its blocks are copied to RAM or disk "
            "(swapped out) and copied back (swapped in), nothing is computed again; the swap space has "
            "as many blocks as the cache, and a chat that no longer fits there is dropped and recomputed;")
    c.print("  [bold]recompute[/] (--preemption recompute): its blocks are dropped and its tokens computed "
            "again when it returns. Either way its answer is the same token for token.")
    space = ("" if o.preemption == "recompute"
             else f", a swap space of {m['kv_cache_blocks']:,} blocks in {o.preemption.removeprefix('swap-').upper()}")
    c.print(f"This run used [bold]{o.preemption}[/]{space}:")
    for mv in d.moves:
        verb = "left" if mv.left else "came back"
        c.print(f"  step {mv.step:>3}: chat {mv.chat + 1} {verb}, {mv.how} ({mv.blocks} blocks): {mv.why}")
    if not d.moves:
        c.print("  no chat had to leave (the cache was large enough)")
    c.print(f"{m['preemptions']} preemptions; {m['swapped_out_blocks']} block copies out and "
            f"{m['swapped_in_blocks']} back in (one per block and layer group).")

    c.rule("[bold]4. The cache beside the plan", align="left")
    c.print(f"[dim]{d.plan_command}[/]")
    if o.tp > 1:
        c.print(f"Each of the {o.tp} tensor-parallel ranks holds this cache: the same blocks, each with "
                f"its share of the KV heads (the plan's figures per GPU at --tp {o.tp}).")
    t = Table(box=box.SIMPLE_HEAD, pad_edge=False)
    for col in ("", "engine (measured)", "kvlab plan (predicted)"):
        t.add_column(col, justify="right" if col else "left")
    eb, pb = m["kv_bytes_per_token"], p["kv_bytes_per_token"]
    t.add_row("KV bytes per token", f"{eb:,} B", f"{pb:,} B")
    t.add_row(f"KV bytes per {bs}-token block", f"{eb * bs:,} B", f"{pb * bs:,} B")
    t.add_row("KV blocks", f"{m['kv_cache_blocks']:,}", f"{p['kv_cache_blocks']:,}")
    t.add_row("KV token slots", f"{m['kv_cache_tokens']:,}", f"{p['kv_cache_tokens']:,}")
    t.add_row("KV cache bytes", f"{m['kv_cache_bytes']:,} B ({fmt_iec(m['kv_cache_bytes'])})",
              f"{p['kv_cache_blocks'] * bs * pb:,} B ({fmt_iec(p['kv_cache_blocks'] * bs * pb)})")
    t.add_row(f"chats of {d.max_model_len} tokens at once", f"{m['max_concurrency']:.2f}",
              f"{p['max_concurrency']:.2f}")
    c.print(t)


def print_evict(rows: list, model: str, context: int, console: Console | None = None) -> None:
    """The eviction table: quality beside the bytes kept and the blocks given back."""
    c = console or Console(width=max(Console().width, 110))
    if rows and rows[0].task != "perplexity":
        return _print_retrieval(rows, model, context, c)
    t = Table(title=f"kvlab evict: perplexity on {model}, {context:,} tokens", title_justify="left",
              box=box.SIMPLE_HEAD, pad_edge=False)
    # headers on two lines, and never narrower than their longest word or a cell, which stay whole
    cols = ["policy", "budget", "KV dtype", "perplexity\n(blocks)", "perplexity\n(tokens)", "(tokens,\nrenumbered)",
            "KV kept\n/ seq", "blocks\nfreed", "tokens\nevicted", "time"]
    _columns(t, cols)
    for r in rows:
        cells = [r.policy, "-" if r.budget is None else str(r.budget), r.kv_dtype]
        cells += ["n/a" if x is None else f"{x:.2f}" for x in (r.quality, r.quality_token, r.quality_token_renumbered)]
        cells += [f"{r.kv_bytes_kept / 2**20:,.2f} MiB", f"{r.blocks_freed:,}", f"{r.tokens_evicted:,}",
                  f"{r.seconds:.1f} s"]
        t.add_row(*cells)
    c.print(t)
    c.print("perplexity (blocks): the paged engine, whole blocks evicted; (tokens): the plain loop, "
            "token by token, each key at its position in the text (as in the engine); (tokens, renumbered): "
            "the loop with positions renumbered inside the cache, as StreamingLLM does. snapkv compresses a finished prompt, and a teacher-forced text is one "
            "prompt to its end, so its perplexity equals full's: judge it on --task needle.")


def _columns(t: Table, cols: list[str]) -> None:
    for col in cols:
        t.add_column(col, justify="left" if col in ("policy", "KV dtype") else "right", no_wrap=True,
                     min_width=max(len(w) for w in col.split()))


def _print_retrieval(rows: list, model: str, context: int, c: Console) -> None:
    from kvlab.ruler import wilson

    """One line per policy, budget and KV dtype; one column per retrieval task (its accuracy and
    95% interval over its trials), their mean, the most KV one sequence kept and the time."""
    tasks = list(dict.fromkeys(r.task for r in rows))
    configs: dict[tuple, list] = {}
    for r in rows:
        configs.setdefault((r.policy, r.budget, r.kv_dtype), []).append(r)
    t = Table(title=f"kvlab evict: {'ruler' if len(tasks) > 1 else tasks[0]} on {model}, {context:,} tokens, "
              f"{rows[0].trials} trials a task", title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False)
    many = len(tasks) > 1  # a column per task, then their mean; else the one task's accuracy
    _columns(t, ["policy", "budget", "KV dtype"] + [name.replace("_", "\n", 1) for name in tasks if many]
             + ["mean\n[95% CI]" if many else "accuracy\n[95% CI]"]
             + ["KV peak\n/ seq", "KV gen.\n/ seq", "blocks\nfreed", "time"])
    for (policy, budget, dtype), group in configs.items():
        by_task = {r.task: r for r in group}
        cells = [policy, "-" if budget is None else str(budget), dtype]
        cells += ["-" if name not in by_task else f"{by_task[name].quality:.0%}" for name in tasks if many]
        n = sum(r.trials for r in group)  # the interval over every trial of the line
        mean = sum(r.quality * r.trials for r in group) / n
        lo, hi = wilson(mean * n, n)
        cells.append(f"{mean:.0%} [{lo:.0%}-{hi:.0%}]")
        cells += [f"{max(r.kv_bytes_kept for r in group) / 2**20:,.2f} MiB",
                  f"{max(r.kv_bytes_decoding or 0 for r in group) / 2**20:,.2f} MiB",
                  f"{sum(r.blocks_freed for r in group):,}", f"{sum(r.seconds for r in group):.1f} s"]
        t.add_row(*cells)
    c.print(t)
    c.print("accuracy: the share of the answers found in the greedy output (kvlab.ruler says how each "
            "task is built), with the 95% Wilson interval over the line's trials (--json: each task's); KV peak: the most one "
            "sequence held (snapkv and adakv hold the whole prompt until it is in); KV gen.: the most while it generated, "
            "its budget plus the step written before the policy evicts.")
