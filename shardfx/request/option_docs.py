"""What each option of ``shardfx.partition`` means: the one text of each, which
``partition``'s docstring, ``shardfx run --help`` (its ``[parallel]`` flags) and the README's
mentions are made from or checked against (``tests/test_option_docs.py``). No torch here:
``--help`` reads it."""

from __future__ import annotations

OPTIONS = {
    "mesh": """The mesh's axes and their sizes, ``{"dp": 2, "tp": 2}`` or ``"dp=2,tp=2"``
        (axes dp_replicate, dp, pp, cp, tp, ep; ``dp_replicate``: HSDP's replicas of the
        ZeRO group dp); None: one device.""",
    "shard": """How parameters are split over the mesh: ``"auto"`` (a solver chooses by the
        device model), ``"megatron"``, ``"megatron-sp"`` (Megatron with sequence parallelism:
        the tokens split over tp between the parallel matmuls), ``"replicate"`` (tp ranks as
        data parallel) or ``{parameter glob: [placement per mesh axis]}``.""",
    "microbatches": """Slices of the batch a step runs one after the other: with a pp axis,
        the pipeline's microbatches (each dp replica's rows in as many); without one, gradient
        accumulation, each slice's forward and backward in turn, their gradients summed, one
        optimizer step over the whole batch (``runtime.accumulate``).""",
    "schedule": """With a pp axis: the pipeline schedule, gpipe | 1f1b | interleaved-1f1b |
        zero-bubble, or a ``Schedule`` or its text form.""",
    "virtual_stages": """With a pp axis: stages per rank, for interleaved-1f1b (default
        2).""",
    "memory_budget": """Bytes per device (an int, a float or "8GiB") the plan must fit:
        activations are recomputed or, where the device model has host memory, offloaded to
        it (``auto.remat``), and in a pipeline fewer microbatches kept in flight, until the
        predicted peak fits, or a ``MemoryBudgetError`` gives the smallest budget that can.""",
    "recompute": """What the backward recomputes instead of keeping: "auto" (the default)
        recomputes (or offloads) the least that fits ``memory_budget``, nothing without one;
        "none" nothing (a budget is checked); "selective" the attention core, the scores and
        their softmax and dropout, from q, k and v (Megatron's and TorchTitan's selective);
        "full" each repeated block's activations from its input (their full activation
        checkpointing) (``auto.recompute``).""",
    "optimizer": """The kind of optimizer ``plan.runner`` will be given (adamw | adam |
        sgd-momentum | sgd | None), for the memory its state takes: the plan is made before the
        optimizer exists, and the runner checks it matches.""",
    "precision": """What matmuls and attention compute in: "fp32" | "bf16" | "fp16", or a
        ``Precision`` that also names the dtype gradients are reduced in across dp
        (``passes.mixed_precision``); parameters, gradients and optimizer state stay fp32;
        fp16 plans scale the loss in the runner.""",
    "kernels": """"compiled" lowers every per-device program with Inductor (C++ on CPU, Triton
        on GPU), one compile per distinct region: each stamped block's forward and backward
        are compiled once and called for every layer (``runtime.lowered``); the first step
        compiles. "triton" runs the memory-bound ops between matmuls as fused Triton kernels
        of shardfx's own (``passes.fusion``; on CPU through Triton's interpreter, slowly),
        "aten" as ATen ops one by one. "auto" (the default) runs ATen ops: a compile costs
        seconds to minutes before the first step, which a short run does not win back.""",
    "fused_loss": """An LM head whose logits only feed a cross-entropy runs as one op over
        chunks of rows, forward and backward, so the (tokens, vocab) logits are never
        materialised (``passes.fused_loss``); False keeps the ATen ops; "auto" fuses only where
        the memory it saves matters: when the plan without it is over ``memory_budget`` or near
        the device's memory (in chunks it never saves time).""",
    "zero": """The ZeRO stage over dp: 1 splits the optimizer's state, 2 and the gradients, 3
        and the parameters (``passes.zero``); "auto" takes the cheapest stage by the device
        model that fits ``memory_budget`` or the device's memory: plain dp where everything
        fits, since each stage only adds collectives (``auto.zero_stage``);
        ``plan.options.zero`` is the stage chosen.""",
    "optimizer_in_backward": """True steps the optimizer on each block's parameters in the
        backward, as soon as their gradients are final, and frees those gradients there
        (``codegen.step_in_backward``): a step never holds the whole model's gradients; it
        cannot clip by the global norm, accumulate batches or scale an fp16 loss, and is not
        in pipelines yet (with ZeRO each rank steps its rows).""",
    "offload_optimizer": """True keeps what the optimizer steps (a copy of this rank's
        parameters, or its ZeRO rows of them) and the optimizer's state in host memory, pinned
        on CUDA, and steps the optimizer there (``torch.optim`` on CPU tensors): each block's
        gradients go to the host as soon as they are final and leave the device
        (``codegen.gradients_to_host``), and the updated values come back after the step
        (``runtime.offload``; in a pipeline a stage's gradients go when its schedule ends). The
        device holds the parameters and activations only; composes with ZeRO-1/2/3, tp, pp,
        clipping, loss scaling and accumulation.""",
    "capacity_factor": """Mixture of experts: each expert takes at most ceil(factor x T x k /
        E) of the T x k (token, expert) pairs of a rank's T tokens per microbatch, the first in
        token order, the rest dropped (the token's residual carries it on); None: dropless,
        every pair computed (``shardfx.experts``, docs/experts.md).""",
    "device": """Where this process's programs run (``kernels.device``): by default
        ``cuda:LOCAL_RANK`` under an NCCL process group, else the model's device; a model on
        the CPU or on meta is planned all the same, and the runner puts its weights there.""",
    "device_model": """The speeds every choice that trades time is made at (stage cuts,
        recomputation, the schedule under a budget, the solver) and ``plan.predicted_step`` is
        predicted on (``cost.device_model``): a preset ("h100", "h200", "gh200", "cpu"), a JSON
        file, or a ``DeviceModel``; by default this machine's ``shardfx calibrate`` file for
        ``device``, else the GPU's preset on CUDA, else "cpu".""",
    "debug": """True (or ``SHARDFX_DEBUG=1``) checks the IR and every pass's contract after
        each pass, and the runners compare every step's batch across ranks (else the first
        step's).""",
}


def summary(name: str) -> str:
    """The first sentence of an option's text, on one line, plain (``--help``'s)."""
    text = " ".join(OPTIONS[name].replace("``", "").split())
    end = text.find(". ")
    return text if end < 0 else text[:end + 1]


def render() -> str:
    """The options as ``partition``'s docstring lists them."""
    return "".join(f"    {name}: {text}\n" for name, text in OPTIONS.items())
