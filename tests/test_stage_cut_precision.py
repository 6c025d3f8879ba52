"""stage_cut under mixed precision: the ops a pass adds to the backward (a weight's cast and
transpose, which no forward op's ``seq_nr`` pairs) run in the stage of the layer they serve,
so a pipeline sends activations and their gradients between stages, never weights."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import shardfx

SEQ = 96  # no weight of the model below has a dimension of 96 or 48


def lm_loss(out, targets):
    return F.cross_entropy(out.logits.flatten(0, 1), targets.flatten())


@pytest.mark.parametrize("mesh, shard", [({"pp": 2}, "megatron"),
                                         ({"pp": 2, "tp": 2}, "megatron-sp")])
def test_only_activations_cross_stages_in_bf16(mesh, shard):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(num_hidden_layers=4, hidden_size=256, intermediate_size=512,
                         num_attention_heads=4, num_key_value_heads=2, vocab_size=1000,
                         use_cache=False)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    ids = torch.randint(0, 1000, (4, SEQ), device="meta")
    plan = shardfx.partition(model, (ids,), lm_loss, (ids,), mesh=mesh, shard=shard,
                             microbatches=4, precision="bf16", device_model="h100")
    program = plan.compiled_stages()
    sent = [(str(action), tuple(program.out_val(part, index).shape))
            for actions in plan.schedule.actions for action in actions
            if action.microbatch == 0
            for (part, index, _), _ in program.messages(action)[0]]
    assert sent
    weights = [(a, shape) for a, shape in sent if SEQ not in shape and SEQ // 2 not in shape]
    assert not weights, f"weight-shaped values sent between stages: {weights}"
