"""Hugging Face checkpoints in and out (``runner.load_hf``, ``runner.save_hf``): what
``save_pretrained`` wrote loads into each rank's shards as ``from_pretrained`` loads it, what
shardfx writes ``from_pretrained`` reads back to the same logits, and a checkpoint that does
not fit is one named error before anything is loaded."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

import shardfx
from shardfx.errors import InputError
from shardfx.runtime import hf_load
from shardfx.testing import adamw

from models import hf, lm_loss, tiny, token_batches

FAMILIES = ("gpt2", "llama", "qwen2", "mixtral", "qwen2_moe")


def model_of(name: str) -> torch.nn.Module:
    return tiny(name) if name in ("gpt2", "llama", "mixtral") else hf(name)


def saved(name: str, root: Path, **kwargs) -> Path:
    """``tiny(name)`` with its own random weights, written by transformers' save_pretrained."""
    path = root / name
    if not path.exists():
        model = model_of(name)
        torch.manual_seed(11)  # weights unlike any model shardfx makes in these tests
        with torch.no_grad():
            for p in model.parameters():
                p.normal_(0, 0.05)
        model.save_pretrained(path, **kwargs)
    return path


def pretrained(path: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path)


def meta_plan(name: str, **kwargs) -> shardfx.Plan:
    (x,), (y,) = token_batches(1)[0]
    with torch.device("meta"):
        model = model_of(name)
    return shardfx.partition(model, (x,), lm_loss, (y,), **kwargs)


@pytest.mark.parametrize("name", FAMILIES)
def test_one_device_loads_what_from_pretrained_loads(name, tmp_path):
    path = saved(name, tmp_path)
    runner = meta_plan(name).runner(adamw)
    runner.load_hf(path)
    want = pretrained(path).state_dict()
    got = runner.state_dict()
    assert set(got) == set(want)
    for k in want:
        assert torch.equal(got[k], want[k]), k


def test_sharded_checkpoints_with_an_index_load(tmp_path):
    path = saved("mixtral", tmp_path, max_shard_size="20KB")
    assert (path / hf_load.INDEX).exists() and len(list(path.glob("*.safetensors"))) > 2
    runner = meta_plan("mixtral").runner()
    runner.load_hf(path)
    want = pretrained(path).state_dict()
    assert all(torch.equal(t, want[k]) for k, t in runner.state_dict().items())


def test_bf16_checkpoints_are_cast_to_the_model_dtype(tmp_path):
    model = tiny("llama").to(torch.bfloat16)
    model.save_pretrained(tmp_path / "bf16")
    runner = meta_plan("llama").runner()
    runner.load_hf(tmp_path / "bf16")
    got = runner.state_dict()
    assert all(got[k].dtype == torch.float32 and torch.equal(got[k], t.float())
               for k, t in model.state_dict().items())


def test_save_hf_is_what_from_pretrained_reads_back(tmp_path):
    """One device: the trained weights written, in save_pretrained's layout (Mixtral's experts
    one tensor per expert again), loaded by transformers to the same logits."""
    batches = token_batches(2)
    runner = meta_plan("mixtral").runner(adamw)
    runner.load_hf(saved("mixtral", tmp_path))
    runner.step(*batches[0])
    out = runner.save_hf(tmp_path / "out", max_shard_bytes=30_000)
    index = json.loads((out / hf_load.INDEX).read_text())
    assert "model.layers.0.block_sparse_moe.experts.3.w2.weight" in index["weight_map"]
    back = pretrained(out)
    (x,), _ = batches[1]
    assert torch.equal(back(x).logits, runner.forward((x,)).logits)
    again = runner.save_hf(tmp_path / "out")  # replaces its own earlier save, all at once
    assert (again / "model.safetensors").exists() and not (again / hf_load.INDEX).exists()


def test_save_hf_refuses_to_replace_another_directory(tmp_path):
    other = tmp_path / "notes"
    other.mkdir()
    (other / "todo.txt").write_text("keep me")
    runner = meta_plan("llama").runner()
    with pytest.raises(InputError, match="is not a Hugging Face checkpoint"):
        runner.save_hf(other)
    assert (other / "todo.txt").read_text() == "keep me"


# --- a checkpoint that does not fit -----------------------------------------------------------

def damaged(tmp_path: Path, how) -> Path:
    """A copy of a saved Llama, its tensors rewritten by ``how(tensors)``."""
    from safetensors.torch import load_file, save_file

    path = tmp_path / "damaged"
    shutil.copytree(saved("llama", tmp_path), path)
    tensors = load_file(path / "model.safetensors")
    how(tensors)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    return path


def refused(path: Path, match: str) -> None:
    runner = meta_plan("llama").runner()
    before = {k: t.clone() for k, t in runner.state_dict().items()}
    with pytest.raises(InputError, match=match) as e:
        runner.load_hf(path)
    assert e.value.where == f"runner.load_hf({str(path)!r})"
    assert all(torch.equal(t, before[k]) for k, t in runner.state_dict().items())  # untouched


def test_a_missing_tensor_is_named(tmp_path):
    path = damaged(tmp_path, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    refused(path, r"1 of the model's tensors are not in it: model.layers.1.mlp.up_proj.weight")


def test_an_unexpected_tensor_is_named(tmp_path):
    path = damaged(tmp_path, lambda t: t.update({"model.extra.weight": torch.ones(2)}))
    refused(path, r"1 of its tensors are not the model's: model.extra.weight")


def test_a_tensor_of_another_shape_is_named(tmp_path):
    def grow(t):
        t["model.norm.weight"] = torch.ones(t["model.norm.weight"].numel() + 1)

    refused(damaged(tmp_path, grow), r"model.norm.weight has shape \[\d+\], the model's")


def test_a_dtype_that_cannot_be_cast_is_named(tmp_path):
    def to_int(t):
        t["model.norm.weight"] = t["model.norm.weight"].to(torch.int32)

    refused(damaged(tmp_path, to_int), r"model.norm.weight is I32, which cannot become the "
                                       r"model's float32")


def test_a_file_cut_short_is_named(tmp_path):
    path = tmp_path / "cut"
    shutil.copytree(saved("llama", tmp_path), path)
    data = (path / "model.safetensors").read_bytes()
    (path / "model.safetensors").write_bytes(data[:len(data) // 2])
    refused(path, r"model.safetensors cannot be read as safetensors: cut short: "
                  r"model\.\S+ ends at byte \d+, the file has \d+")


def test_a_header_that_reads_one_tensor_as_another_is_refused(tmp_path):
    """q_proj's range pointed at o_proj's bytes (same shape and dtype): the values would load
    without a word; the header's ranges overlap, so the file is refused by name."""
    from test_safetensors_header import rewrite, split

    path = tmp_path / "overlap"
    shutil.copytree(saved("llama", tmp_path), path)
    header, data = split(path / "model.safetensors")
    q, o = (f"model.layers.0.self_attn.{p}_proj.weight" for p in "qo")
    assert header[q]["shape"] == header[o]["shape"]
    header[q]["data_offsets"] = header[o]["data_offsets"]
    rewrite(path / "model.safetensors", header, data)
    refused(path, r"model.safetensors cannot be read as safetensors: .*overlaps")


def test_a_git_lfs_pointer_is_named_as_one(tmp_path):
    path = tmp_path / "pointer"
    shutil.copytree(saved("llama", tmp_path), path)
    (path / "model.safetensors").write_text("version https://git-lfs.github.com/spec/v1\n"
                                            "oid sha256:4d7a2f\nsize 261711\n")
    runner = meta_plan("llama").runner()
    with pytest.raises(InputError, match="it is a Git LFS pointer, not the file it points to") \
            as e:
        runner.load_hf(path)
    assert "git lfs pull" in e.value.fix


def test_an_index_naming_a_missing_file_is_named(tmp_path):
    path = tmp_path / "lost"
    shutil.copytree(saved("mixtral", tmp_path, max_shard_size="20KB"), path, dirs_exist_ok=True)
    next(iter(sorted(path.glob("model-*.safetensors")))).unlink()
    runner = meta_plan("mixtral").runner()
    with pytest.raises(InputError, match="names 1 files that are not there: model-00001-of"):
        runner.load_hf(path)


def test_a_directory_without_safetensors_is_named(tmp_path):
    refused(tmp_path, "holds neither model.safetensors nor model.safetensors.index.json")
    refused(tmp_path / "absent", "is not a directory")


# --- on a mesh -------------------------------------------------------------------------------

MESHES = [
    ({"dp": 4}, {"zero": 3}),
    ({"dp": 2, "tp": 2}, {"shard": "megatron"}),
    ({"pp": 2, "tp": 2}, {"shard": "megatron", "microbatches": 2}),
]


EP = ({"ep": 2, "dp": 2}, {})
EVERY = [(name, *mesh) for name in FAMILIES for mesh in MESHES] + [
    (name, *EP) for name in ("mixtral", "qwen2_moe")]
SOME = [("gpt2", *MESHES[2]), ("llama", *MESHES[0]), ("qwen2", *MESHES[1]),
        ("mixtral", *MESHES[2]), ("mixtral", *EP), ("qwen2_moe", *EP)]


def _load_everywhere(root: str, cases: list[tuple]) -> list[tuple]:
    """On every rank: each (family, mesh, options) loaded; its full state; and how many
    values this rank read against the model's."""
    out = []
    for name, mesh, kw in cases:
        runner = meta_plan(name, mesh=mesh, **kw).runner()
        ckpt = hf_load.Checkpoint
        count = [0]
        copy, read = ckpt.copy, ckpt.read  # count what the rank reads: its rows, not the model

        def copying(self, out, key, region):
            copy(self, out, key, region)
            count[0] += out.numel()

        def reading(self, key):
            t = read(self, key)
            count[0] += t.numel()
            return t

        ckpt.copy, ckpt.read = copying, reading
        try:
            runner.load_hf(Path(root) / name)
        finally:
            ckpt.copy, ckpt.read = copy, read
        total = sum(t.numel() for t in runner.plan.model.parameters())
        out.append((name, str(mesh), runner.state_dict(), count[0] / total))
    return out


def loads_everywhere(root: Path, cases: list[tuple]) -> None:
    for name in FAMILIES:
        saved(name, root)
    ranks = shardfx.launch(_load_everywhere, str(root), cases, nprocs=4, timeout=300,
                           deadline=1800)
    want = {name: pretrained(root / name).state_dict() for name in FAMILIES}
    for rank in ranks:
        for name, mesh, state, share in rank:
            bad = [k for k, t in want[name].items() if not torch.equal(state[k], t)]
            assert not bad, (name, mesh, bad[:3])
            if mesh == "{'dp': 4}" and name in ("gpt2", "llama", "qwen2"):
                assert share < 0.3, (name, mesh, share)  # its ZeRO rows, not the model


@pytest.mark.multiprocess
def test_each_family_loads_on_a_mesh_what_from_pretrained_loads(tmp_path):
    """A cross-section of the matrix: every family, every kind of mesh, on 4 ranks."""
    loads_everywhere(tmp_path, SOME)


@pytest.mark.slow
def test_every_family_loads_on_every_mesh(tmp_path):
    """GPT-2, Llama, Qwen2, Mixtral and Qwen2-MoE on dp=4 ZeRO-3, dp=2 x tp=2, pp=2 x tp=2,
    and the MoE families' experts on ep=2 x dp=2. ``pytest -m slow``."""
    loads_everywhere(tmp_path, EVERY)


def _save_everywhere(root: str, name: str, mesh: dict, kw: dict) -> dict:
    runner = meta_plan(name, mesh=mesh, **kw).runner(adamw)
    runner.load_hf(Path(root) / name)
    runner.step(*token_batches(1)[0])
    runner.save_hf(Path(root) / f"{name}-out", max_shard_bytes=40_000)
    return runner.state_dict()


@pytest.mark.multiprocess
def test_save_hf_on_a_mesh_reads_back_to_the_same_logits(tmp_path):
    for name, (mesh, kw) in [("gpt2", MESHES[2]), ("mixtral", MESHES[0])]:
        saved(name, tmp_path)
        state = shardfx.launch(_save_everywhere, str(tmp_path), name, mesh, kw, nprocs=4,
                               timeout=300)[0]
        back = pretrained(tmp_path / f"{name}-out")
        reference = model_of(name)
        reference.load_state_dict(state)
        (x,), _ = token_batches(1)[0]
        assert torch.equal(back(x).logits, reference(x).logits), name


FACTORY = """
import itertools, torch, transformers as T
def workload():
    config = T.LlamaConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=64,
                           num_attention_heads=4, num_key_value_heads=2, vocab_size=64)
    with torch.device("meta"):
        model = T.LlamaForCausalLM(config)
    ids = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(0))
    loss = lambda out, t: torch.nn.functional.cross_entropy(out.logits.flatten(0, 1),
                                                            t.flatten())
    return {"model": model, "args": (ids,), "loss_fn": loss, "targets": (ids,),
            "batches": itertools.repeat(((ids,), (ids,)))}
"""


@pytest.mark.multiprocess
def test_shardfx_run_starts_from_and_exports_hugging_face_checkpoints(tmp_path):
    """``shardfx run --init-from``: the first loss is the pretrained model's; ``--export-hf``:
    transformers loads what the run trained."""
    from shardfx.run import cli

    (tmp_path / "factory.py").write_text(FACTORY)
    source = saved("llama", tmp_path)
    out, log = tmp_path / "trained", tmp_path / "run.jsonl"
    assert cli.main(["run", f"{tmp_path / 'factory.py'}:workload", "--mesh", "dp=2,tp=2",
                     "--steps", "2", "--init-from", str(source), "--export-hf", str(out),
                     "--jsonl", str(log)]) == 0
    records = [json.loads(line) for line in log.read_text().splitlines()]
    steps = [r for r in records if "loss" in r]
    assert [r["path"] for r in records if r.get("event") == "export_hf"] == [str(out)]
    ids = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(0))
    want = lm_loss(pretrained(source)(ids), ids).item()
    assert steps[0]["loss"] == pytest.approx(want, rel=1e-5)
    trained = pretrained(out)
    assert lm_loss(trained(ids), ids).item() < want  # two steps of AdamW on one batch


def _save_hf_with_a_full_disk_on_rank_1(root: str) -> str:
    import safetensors.torch

    runner = meta_plan("llama", mesh={"dp": 2}).runner()
    runner.load_hf(Path(root) / "llama")
    if torch.distributed.get_rank() == 1:
        def full(tensors, filename, metadata=None):
            raise OSError(28, "No space left on device", filename)

        safetensors.torch.save_file = full
    try:
        runner.save_hf(Path(root) / "llama", max_shard_bytes=20_000)  # over its own save
    except shardfx.CheckpointError as e:
        return e.cause
    return "saved"


@pytest.mark.multiprocess
def test_save_hf_that_fails_on_one_rank_is_named_on_every_rank(tmp_path):
    """Not a peer waiting at a barrier until its timeout: every rank raises the same
    CheckpointError, and the checkpoint there is as it was."""
    path = saved("llama", tmp_path)
    before = {p.name: p.read_bytes() for p in path.iterdir()}
    said = shardfx.launch(_save_hf_with_a_full_disk_on_rank_1, str(tmp_path), nprocs=2,
                          timeout=60)
    assert said[0] == said[1] and "rank 1: OSError: [Errno 28] No space left" in said[0], said
    assert {p.name: p.read_bytes() for p in path.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["llama"]
