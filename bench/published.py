"""The step-time model against published, measured training steps.

Each row of ``bench/published.csv`` (carried from the sources it names: NVIDIA's DGX Cloud
benchmark recipes for Llama 3.1 and GPT-3 on DGX H100, Megatron's SC21 and
activation-recomputation papers and MegaScale's Megatron-LM baseline on DGX A100) is a
training run at an exact configuration with its measured step. This script builds the row's
model on the meta device, plans it at that configuration and prices one optimizer step with
``plan.predicted_step`` on the row's system (``device_model="h100"`` or ``"a100"``,
docs/device-models.md), then prints predicted against measured tokens/s per GPU (and, for
rows that give Megatron's Eq. 3 TFLOP/s, that figure too).

The configuration, as the source ran it (``translate``):

    mesh            dp, pp, cp, tp of the row (ranks row-major in shardfx's axis order)
    microbatches    gbs / (mbs * dp): the pipeline's microbatches, or without pp the passes
                    the plan accumulates over (one optimizer step of gbs sequences)
    schedule        interleaved-1f1b with virtual_stages = vp where the row has vp > 1
    shard           megatron-sp where sp is on, megatron with a tp axis, else megatron
                    (no tp: nothing to split)
    zero            distopt -> 1, fsdp -> 3, ddp -> 0
    recompute       the row's none / selective / full
    precision       the row's bf16 / fp16
    fused_loss      False: the LM head's logits, then the loss on them, as Megatron computes
                    them (and no choice between the two to plan)
    model           Llama 3.1 rows: LlamaForCausalLM (its hidden, ffn, heads, KV heads,
                    vocabulary, untied); GPT rows: examples/nanogpt.py's GPT (Megatron's
                    GPT: learned positions, LayerNorm, GELU, biases, tied embedding), no
                    dropout (SDPA's flash kernel takes none)

Where the row leaves a field out ("-") the value and its source are in ``FILLED``. Where the
published system used a technique shardfx's program lacks (``step_time.TECHNIQUES``: weights
kept in the compute dtype, cuDNN's attention, the embedding and LM head split over tp by
vocabulary, tp communication overlapped with the matmuls, gradients reduced once per
accumulated step, the parameter all-gather overlapped with the next forward, fused
memory-bound kernels in the compute dtype, a pipeline's messages scattered over tp), the row
names it and is priced both ways: "as is" is shardfx's program, "with" is the program with those techniques; the ratio
compared with the goal is the one with them (the system that was measured). Techniques the
step model cannot price yet are named in the notes column and not priced.

Per row: id, configuration, measured and predicted tokens/s/GPU, ratio (predicted /
measured), what dominates the predicted step (compute, exposed communication, pipeline
bubble: their shares), predicted peak memory per device (the largest rank's, a pipeline's
sends held as on NCCL, which the runs used: ``memory_breakdown(transport="nccl")``; they ran on 80
GB) as is and, where it differs, with the row's techniques (``memory_breakdown(assume=)``: the
weights and activations in the compute dtype beside an fp32 main copy, the vocabulary split
over tp, the distributed optimizer over dp x cp, a tied embedding's copy on the last stage;
``cost.techniques``), marked "> 80" where the figure of
the system that ran (with them) is over, planning seconds. Below: the median and worst
|ratio - 1| and the weak-scaling pairs'
measured and predicted change. A row shardfx refuses to plan shows the refusal's first line.

    python -m bench.published [--rows llama31-8b-8,kort-22b-sel] [--no-append]

Prints the table and appends it to bench/RESULTS.md with the machine and date, and updates
the ``published`` row of its "Current figures".
"""

from __future__ import annotations

import argparse
import csv
import io
import re
import statistics
import sys
import time
import traceback
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

import shardfx
from bench.common import RESULTS, append_results, machine
from shardfx.estimate.step_time import predict_step

warnings.filterwarnings("ignore")

DATA = Path(__file__).with_name("published.csv")
SYSTEMS = {"dgx-h100": "h100", "dgx-a100": "a100"}  # the row's system -> device model preset
GOAL = (0.10, 0.25)  # median and worst |ratio - 1| (the worst: rows without a missing technique)
WEAK_POINTS = 0.03  # weak-scaling pairs: predicted change within 3 points of the measured one

# Fields a row leaves out ("-"), with where the value comes from.
FILLED = {
    # Megatron-LM examples/sc21/run_table_1.sh: the micro-batch size of each Table 1 run and
    # its layers per virtual stage (145B: 5 of 80 layers on pp=8, so 2 virtual stages; 1T: no
    # interleaving in the script, though the CSV's note says interleaved).
    "sc21-1.7b": {"mbs": 16},
    "sc21-18.4b": {"mbs": 8},
    "sc21-145.6b": {"mbs": 2, "vp": 2},
    "sc21-1t": {"mbs": 1},
    # MegaScale's Megatron-LM baseline does not say what it recomputes; Megatron's default is
    # nothing, and the configuration fits 80 GB without it (this table's memory column).
    "megascale-175b-256": {"recompute": "none"},
    "megascale-175b-1024": {"recompute": "none"},
}

# Techniques the row's system used that shardfx's program lacks: (priced, not priced). The
# priced ones are ``step_time.TECHNIQUES``; the others are named only.
NEMO_DDP = "param-gather-overlap"  # NeMo 2 recipes' distributed optimizer overlaps it
# Sources whose runs predate FlashAttention in Megatron-LM (its --use-flash-attn came in
# 2023): their attention is Megatron's unfused core attention, with dropout.
BEFORE_FLASH = ("Narayanan et al. SC21", "Korthikanti et al. 2022")


@dataclass(frozen=True)
class Row:
    """One published run (bench/published.csv's columns)."""

    id: str
    source: str
    system: str
    precision: str
    model: str
    layers: int
    hidden: int
    ffn: int
    heads: int
    kv_heads: int
    vocab: int
    gpus: int
    gbs: int
    mbs: int
    seq: int
    tp: int
    pp: int
    cp: int
    vp: int
    dp: int
    sharding: str
    recompute: str
    sp: bool
    measure: str
    value: float
    notes: str

    @property
    def tokens_per_step(self) -> int:
        return self.gbs * self.seq

    def eq3_flops(self) -> float:
        """Megatron SC21 Eq. 3: FLOPs of one step, counting the recomputed forward."""
        b, s, l, h, v = self.gbs, self.seq, self.layers, self.hidden, self.vocab
        return 96 * b * s * l * h * h * (1 + s / (6 * h) + v / (16 * l * h))

    def measured_tokens(self) -> float:
        """Measured tokens/s per GPU."""
        step = self.value if self.measure == "step_s" else \
            self.eq3_flops() / (self.value * 1e12 * self.gpus)
        return self.tokens_per_step / (step * self.gpus)


def read_rows(path: Path = DATA) -> list[Row]:
    """The rows of ``path`` (``#`` lines are its header notes), with ``FILLED``'s values. A
    row whose source is "same as ID" ran ID's recipe at another scale: it takes ID's source
    and notes (the techniques its system used), then its own notes."""
    text = "\n".join(line for line in path.read_text().splitlines()
                     if not line.startswith("#"))
    out, seen = [], {}
    for raw in csv.DictReader(io.StringIO(text)):
        raw = {**raw, **{k: str(v) for k, v in FILLED.get(raw["id"], {}).items()}}
        base = seen.get(raw["source"].removeprefix("same as ").strip())
        if raw["source"].startswith("same as ") and base is not None:
            notes = [n for n in (base["notes"], raw["notes"]) if n.strip() not in ("", "-")]
            raw = {**raw, "source": base["source"], "notes": "; ".join(dict.fromkeys(notes))}
        seen[raw["id"]] = raw

        def num(key: str, default: int = 1) -> int:
            word = raw[key].split()[0] if raw[key].strip() else "-"
            return default if word == "-" else int(word)

        out.append(Row(raw["id"], raw["source"], raw["system"], raw["precision"], raw["model"],
                       num("layers"), num("hidden"), num("ffn"), num("heads"), num("kv_heads"),
                       num("vocab"), num("gpus"), num("gbs"), num("mbs"), num("seq"), num("tp"),
                       num("pp"), num("cp"), num("vp"), num("dp"), raw["sharding"],
                       raw["recompute"], raw["sp"] == "on", raw["measure"], float(raw["value"]),
                       raw["notes"]))
    return out


@dataclass(frozen=True)
class Config:
    """A row as ``partition``'s arguments, and what its system did beyond shardfx's program."""

    mesh: dict[str, int]
    kwargs: dict  # microbatches, schedule, virtual_stages, shard, zero, recompute, precision
    device_model: str
    techniques: tuple[str, ...] = ()  # priced (step_time.TECHNIQUES)
    unpriced: tuple[str, ...] = ()  # named only
    notes: tuple[str, ...] = field(default=())

    def label(self) -> str:
        mesh = "x".join(f"{a}{n}" for a, n in self.mesh.items())
        k = self.kwargs
        parts = [mesh, f"m{k['microbatches']}"]
        if k.get("virtual_stages", 1) > 1:
            parts.append(f"vp{k['virtual_stages']}")
        parts += [k["shard"].replace("megatron", "mt"), f"z{k['zero']}", k["recompute"][:3]]
        return " ".join(parts)


def translate(row: Row) -> Config:
    """The row's configuration as shardfx's arguments (module docstring)."""
    if row.dp * row.tp * row.pp * row.cp != row.gpus:
        raise ValueError(f"{row.id}: dp*tp*pp*cp = {row.dp * row.tp * row.pp * row.cp}, "
                         f"not its {row.gpus} GPUs")
    mesh = {a: n for a, n in (("dp", row.dp), ("pp", row.pp), ("cp", row.cp), ("tp", row.tp))
            if n > 1}
    per_step = row.gbs // (row.mbs * row.dp)
    if per_step * row.mbs * row.dp != row.gbs:
        raise ValueError(f"{row.id}: gbs {row.gbs} is not a multiple of mbs x dp")
    kwargs = {"microbatches": per_step, "precision": row.precision, "fused_loss": False,
              "shard": "megatron-sp" if row.sp and row.tp > 1 else "megatron",
              "zero": {"distopt": 1, "fsdp": 3}.get(row.sharding, 0),
              "recompute": row.recompute}
    if row.pp > 1:
        kwargs["schedule"] = "interleaved-1f1b" if row.vp > 1 else "1f1b"
        kwargs["virtual_stages"] = row.vp
    # Every row's system is Megatron's (Megatron-LM; NeMo on Megatron-core): its weights are
    # in the compute dtype (the fp32 master in the optimizer), its embedding and LM head split
    # over tp by vocabulary, its memory-bound ops fused kernels in the compute dtype (apex's
    # and Megatron's in 2021-22: FusedLayerNorm, bias-GeLU, bias-dropout-add; Transformer
    # Engine's in NeMo: RMSNorm, SwiGLU, RoPE, cross-entropy), and without sequence parallel
    # a pipeline's messages scattered over tp and gathered again (scatter/gather, SC21
    # sec. 4.1); NeMo's attention is Transformer Engine's (cuDNN's kernel).
    techniques, unpriced, notes = ["low-precision-weights"], [], []
    nemo = "NeMo" in row.source or row.id.startswith(("llama31", "gpt3"))
    if nemo and row.system == "dgx-h100":
        techniques.append("vendor-attention")
    if row.tp > 1:
        techniques.append("vocab-parallel")
    if row.tp > 1 and ("tp_comm_overlap" in row.notes or "tp comm" in row.notes):
        techniques.append("tp-overlap")
    if row.source.startswith(BEFORE_FLASH):
        techniques.append("unfused-attention")
    techniques.append("fused-elementwise")  # Megatron's fused norms, activations, adds
    if row.pp > 1 and row.tp > 1 and not row.sp:  # Megatron's p2p without sequence parallel
        techniques.append("p2p-scatter-gather")
    if (row.pp == 1 and per_step > 1) or (row.pp > 1 and row.cp > 1 and row.dp > 1):
        techniques.append("grad-reduce-once")  # a pipeline's cp: reduced with dp, once
    if row.sharding == "distopt" and nemo:
        techniques.append(NEMO_DDP)
    if "deferred embedding wgrad" in row.notes:
        unpriced.append("deferred embedding wgrad")
    if row.cp > 1 and row.sharding == "distopt":  # Megatron's dp group includes cp
        techniques.append("optimizer-over-dp-cp")
    if row.pp > 1 and not row.model.startswith("Llama"):  # GPT's tied embedding: Megatron's
        techniques.append("embedding-grad-once")  # copy on the last stage
    return Config(mesh, kwargs, SYSTEMS[row.system], tuple(techniques), tuple(unpriced),
                  tuple(notes))


def build(row: Row) -> tuple[torch.nn.Module, tuple, object, tuple]:
    """The row's model on the meta device, one global batch of token ids, loss, targets."""
    ids = torch.randint(0, row.vocab, (row.gbs, row.seq), device="meta")
    if row.model.startswith("Llama"):
        from transformers import LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(num_hidden_layers=row.layers, hidden_size=row.hidden,
                             intermediate_size=row.ffn, num_attention_heads=row.heads,
                             num_key_value_heads=row.kv_heads, vocab_size=row.vocab,
                             max_position_embeddings=row.seq, tie_word_embeddings=False,
                             use_cache=False)
        with torch.device("meta"):
            model = LlamaForCausalLM(config)
        return model, (ids,), _hf_loss, (ids,)
    from examples.nanogpt import GPT, GPTConfig, loss_fn

    if row.ffn != 4 * row.hidden or row.kv_heads != row.heads:
        raise ValueError(f"{row.id}: a GPT row with ffn {row.ffn} and {row.kv_heads} KV heads "
                         "(nanoGPT's GPT has 4 x hidden and one KV head per head)")
    with torch.device("meta"):
        model = GPT(GPTConfig(block_size=row.seq, vocab_size=row.vocab, n_layer=row.layers,
                              n_head=row.heads, n_embd=row.hidden, dropout=0.0, bias=True))
    return model, (ids,), loss_fn, (ids,)


def _hf_loss(out, targets):
    return F.cross_entropy(out.logits.flatten(0, 1), targets.flatten())


@dataclass
class Result:
    row: Row
    config: Config | None
    plan_s: float = 0.0
    as_is: object = None  # PredictedStep
    with_: object = None  # PredictedStep with the techniques (None: the row names none)
    memory: float = 0.0  # predicted peak bytes, the largest rank's
    memory_with: float = 0.0  # ... with the techniques (0: the row names none)
    refused: str = ""

    @property
    def predicted(self):
        return self.with_ or self.as_is

    def tokens(self, step) -> float:
        return self.row.tokens_per_step / (step.total * self.row.gpus)

    @property
    def ratio(self) -> float:
        return self.tokens(self.predicted) / self.row.measured_tokens()


def price(row: Row) -> Result:
    """Plan ``row`` at its configuration and price its step, as is and with its techniques."""
    try:
        config = translate(row)
    except ValueError as e:
        return Result(row, None, refused=str(e))
    start = time.process_time()
    try:
        model, args, loss, targets = build(row)
        plan = shardfx.partition(model, args, loss, targets, mesh=config.mesh,
                                 device_model=config.device_model, **config.kwargs)
        as_is = plan.predicted_step
        with_ = predict_step(plan, assume=config.techniques) if config.techniques else None
        memory, memory_with = (peak_memory(plan, assume) for assume in ((), config.techniques))
    except Exception as e:  # a refusal is a row of the table, named
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        if "-v" in sys.argv:
            traceback.print_exc()
        return Result(row, config, time.process_time() - start,
                      refused=f"{type(e).__name__}: {first}")
    return Result(row, config, time.process_time() - start, as_is, with_, memory,
                  memory_with if config.techniques else 0.0)


def peak_memory(plan, assume=()) -> int:
    """The largest rank's predicted peak bytes, a pipeline's sends held as on NCCL, with the
    techniques ``assume`` names."""
    return max(m.total for m in plan.memory_breakdown(transport="nccl", assume=assume).values())


def memory_cell(r: Result) -> str:
    """GB as is, and with the techniques where they differ; "> 80" where the system that
    ran (with them, where the row names any) is over its GPUs' 80 GB."""
    ran = r.memory_with or r.memory
    both = f"{r.memory / 1e9:.1f}" + (f" / {ran / 1e9:.1f}" if round(ran / 1e8) !=
                                     round(r.memory / 1e8) else "")
    return both + (" (> 80)" if ran > 80e9 else "")


def dominant(step) -> str:
    """Shares of the step: compute, exposed communication, pipeline bubble."""
    parts = {"compute": step.compute, "comm": step.waiting, "bubble": step.idle}
    total = sum(parts.values()) or 1.0
    return " ".join(f"{k} {v / total:.0%}" for k, v in parts.items() if v / total >= 0.005)


def table(results: list[Result]) -> str:
    head = ("| row | system | configuration | measured tok/s/GPU | predicted as is | "
            "with techniques | ratio | step (pred / meas) | dominates | "
            "memory GB as is / with | "
            "missing techniques | plan s |")
    lines = [head, "|---|---|---|---:|---:|---:|---:|---:|---|---:|---|---:|"]
    for r in results:
        row = r.row
        if r.refused:
            lines.append(f"| {row.id} | {row.system} | {r.config.label() if r.config else '-'} "
                         f"| {row.measured_tokens():.0f} | refused: {r.refused} | | | | | | | "
                         f"{r.plan_s:.0f} |")
            continue
        with_ = f"{r.tokens(r.with_):.0f}" if r.with_ else "-"
        measured_step = row.tokens_per_step / (row.measured_tokens() * row.gpus)
        missing = ", ".join(r.config.techniques + tuple(f"{t} (not priced)"
                                                        for t in r.config.unpriced))
        notes = "; ".join(r.config.notes)
        lines.append(
            f"| {row.id} | {row.system} | {r.config.label()} | {row.measured_tokens():.0f} | "
            f"{r.tokens(r.as_is):.0f} | {with_} | {r.ratio:.2f} | "
            f"{r.predicted.total:.2f} / {measured_step:.2f} s | {dominant(r.predicted)} | "
            f"{memory_cell(r)} | "
            f"{missing or '-'}{'; ' + notes if notes else ''} | {r.plan_s:.0f} |")
    return "\n".join(lines)


def summary(results: list[Result]) -> tuple[str, dict]:
    """The median and worst |ratio - 1| and the weak-scaling pairs, as text and figures."""
    priced = [r for r in results if not r.refused]
    errors = {r.row.id: abs(r.ratio - 1) for r in priced}
    if not errors:
        return "no row priced", {}
    median = statistics.median(errors.values())
    worst_id = max(errors, key=errors.get)
    plain = {k: v for k, v in errors.items()
             if not next(r for r in priced if r.row.id == k).config.unpriced}
    lines = [f"median |ratio - 1| {median:.1%} over {len(errors)} rows (goal <= "
             f"{GOAL[0]:.0%}); worst {errors[worst_id]:.1%} ({worst_id}); rows past "
             f"{GOAL[1]:.0%}: " + (", ".join(f"{k} {v:.0%}" for k, v in errors.items()
                                            if v > GOAL[1]) or "none")]
    if len(errors) < len(results):
        lines.append("refused: " + ", ".join(r.row.id for r in results if r.refused))
    by_id = {r.row.id: r for r in priced}
    for small, large in weak_pairs([r.row for r in results]):
        if small in by_id and large in by_id:
            a, b = by_id[small], by_id[large]
            measured = b.row.measured_tokens() / a.row.measured_tokens() - 1
            predicted = b.tokens(b.predicted) / a.tokens(a.predicted) - 1
            ok = abs(predicted - measured) <= WEAK_POINTS
            lines.append(f"weak scaling {small} -> {large}: tokens/s/GPU measured "
                         f"{measured:+.1%}, predicted {predicted:+.1%} "
                         f"({'within' if ok else 'past'} {WEAK_POINTS:.0%} points)")
    figures = {"median": median, "worst": errors[worst_id], "worst_id": worst_id,
               "rows": len(errors), "plain_worst": max(plain.values(), default=0.0)}
    return "\n".join(lines), figures


def weak_pairs(rows: list[Row]) -> list[tuple[str, str]]:
    """(smaller, larger) ids of rows whose notes say one is the other's weak scaling."""
    out = []
    for row in rows:
        m = re.search(r"weak scaling of (\S+)", row.notes)
        if m:
            out.append((m.group(1), row.id))
    return out


def update_current(figures: dict, results: list[Result], date: str) -> None:
    """The ``published`` row of RESULTS.md's "Current figures" table, replaced or added."""
    if not figures:
        return
    ratios = ", ".join(f"{r.row.id} {r.ratio:.2f}" for r in results if not r.refused)
    text = (f"| published | {date} | {figures['rows']} published runs priced at their exact "
            f"configurations (bench/published.csv): median \\|predicted/measured - 1\\| "
            f"**{figures['median']:.1%}**, worst {figures['worst']:.1%} ({figures['worst_id']}); "
            f"ratios {ratios} | median <= 10%, none past 25% but rows with a named missing "
            f"technique |")
    lines = RESULTS.read_text().splitlines()
    at = next((i for i, line in enumerate(lines) if line.startswith("| published |")), None)
    if at is None:  # after the table's last row
        start = lines.index("## Current figures")
        at = next(i for i in range(start + 1, len(lines))
                  if lines[i].startswith("|") and not lines[i + 1].startswith("|"))
        lines.insert(at + 1, text)
    else:
        lines[at] = text
    RESULTS.write_text("\n".join(lines) + "\n")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default="", help="comma-separated row ids (default: every row)")
    p.add_argument("--no-append", action="store_true", help="print only")
    p.add_argument("-v", action="store_true", help="tracebacks of refused rows")
    a = p.parse_args()
    wanted = set(filter(None, a.rows.split(",")))
    results = []
    for row in read_rows():
        if wanted and row.id not in wanted:
            continue
        results.append(price(row))
        print(table(results[-1:]).splitlines()[-1], flush=True)
    text = table(results)
    notes, figures = summary(results)
    print("\n" + text + "\n\n" + notes)
    if not a.no_append:
        import datetime

        intro = ("Published, measured training steps (bench/published.csv, sources per row) "
                 "priced at their exact configurations on the meta device: predicted "
                 "tokens/s/GPU of shardfx's program as is and with the techniques the measured "
                 "system used that the program lacks (bench/published.py's docstring); ratio = "
                 "predicted (with them) / measured; memory = predicted peak per device; plan s "
                 "= CPU seconds to plan.")
        append_results("published", f"{intro}\n\n{text}\n\n{notes}", machine())
        update_current(figures, results, datetime.date.today().isoformat())


if __name__ == "__main__":
    main()
