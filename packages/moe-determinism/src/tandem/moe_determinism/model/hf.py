"""Save/load in the Hugging Face layout (config.json + safetensors, sharded or not).

The tensor names are those of each family's checkpoints on the Hub (`families`: one tensor
per expert projection, dense layers as ``mlp.{gate,up,down}_proj``, Mixtral's
``block_sparse_moe.experts.{e}.w1/w3/w2``, DeepSeek-V3's MLA projections and
``mlp.shared_experts``), which transformers and vLLM load directly. A shared expert, which Qwen3-MoE on the Hub does not have, is written
as ``mlp.shared_expert.{gate,up,down}_proj`` and flagged in the config with
``shared_expert_intermediate_size``, with the sigmoid gate vLLM's Qwen3-MoE multiplies it by
(``mlp.shared_expert_gate``, as in Qwen2-MoE) set so that the gated expert is tandem's
ungated one bit for bit: a zero gate (sigmoid(0) = 1/2 exactly) and the down projection
doubled (a power of two: exact both ways). Without the gate, vLLM would multiply by
whatever its uninitialised gate holds.

Loading streams: the model is built without memory (meta device), then materialised once in
the target dtype and filled tensor by tensor from memory-mapped shards, so the host holds
the model plus one tensor, never a second copy of the checkpoint.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import NamedTuple

import msgspec
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from tandem.moe_determinism.errors import MoEDeterminismError
from tandem.moe_determinism.model.config import MoEConfig
from tandem.moe_determinism.model.hf_config import to_hf_config
from tandem.moe_determinism.model.layers import MoEBlock, SwiGLU
from tandem.moe_determinism.model.model_dir import INDEX_FILE, SINGLE_FILE, config_from_dir
from tandem.moe_determinism.model.transformer import MoETransformer


def _swiglu_names(prefix: str, mlp: SwiGLU) -> dict[str, torch.Tensor]:
    return {
        f"{prefix}{n}.weight": getattr(mlp, n).weight for n in ("gate_proj", "up_proj", "down_proj")
    }


def hf_tensors(model: MoETransformer) -> dict[str, torch.Tensor]:
    """Hugging Face name -> the model's tensor holding it (a view of a stacked expert
    parameter for per-expert names), in the names of the model's family (`families`).
    Shared by save (read) and load (write in place)."""
    cfg = model.config
    fam = cfg.family
    out: dict[str, torch.Tensor] = {
        "model.embed_tokens.weight": model.embed_tokens.weight,
        "model.norm.weight": model.norm.weight,
    }
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = model.lm_head.weight
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        out[p + "input_layernorm.weight"] = layer.input_layernorm.weight
        out[p + "post_attention_layernorm.weight"] = layer.post_attention_layernorm.weight
        out.update(layer.self_attn.hf_tensors(p + "self_attn."))
        mlp = layer.mlp
        if isinstance(mlp, SwiGLU):
            out.update(_swiglu_names(p + "mlp.", mlp))
            continue
        assert isinstance(mlp, MoEBlock)
        m = f"{p}{fam.moe_module}."
        out[m + "gate.weight"] = mlp.gate.weight
        bias = getattr(mlp.gate, "e_score_correction_bias", None)
        if bias is not None:
            out[m + "gate.e_score_correction_bias"] = bias
        for e in range(cfg.num_experts):
            for ours, theirs in zip(
                ("gate_proj", "up_proj", "down_proj"), fam.expert_names, strict=True
            ):
                out[f"{m}experts.{e}.{theirs}.weight"] = getattr(mlp, ours)[e]
        if mlp.shared_expert is not None:
            out.update(_swiglu_names(f"{m}{fam.shared_expert_module}.", mlp.shared_expert))
    return out


SHARED_GATE = "mlp.shared_expert_gate.weight"
SHARED_DOWN = "mlp.shared_expert.down_proj.weight"
SHARED_DOWN_SCALE = 2.0
"""The shared expert's down projection is written times this, beside a zero gate (1/2)."""


def _shared_expert_layers(model: MoETransformer) -> list[str]:
    """The name prefix of every layer with a shared expert."""
    if not model.config.family.shared_expert_gated:
        return []
    return [
        f"model.layers.{i}."
        for i, layer in enumerate(model.layers)
        if isinstance(layer.mlp, MoEBlock) and layer.mlp.shared_expert is not None
    ]


def checkpoint_tensors(model: MoETransformer) -> dict[str, torch.Tensor]:
    """What `save_hf` writes: `hf_tensors`, plus each shared expert's gate (zeros) and its
    down projection doubled (fresh tensors; the rest are the model's own)."""
    out = dict(hf_tensors(model))
    for p in _shared_expert_layers(model):
        down = out[p + SHARED_DOWN]
        out[p + SHARED_DOWN] = down.detach() * SHARED_DOWN_SCALE
        out[p + SHARED_GATE] = down.new_zeros(1, down.shape[0])
    return out


class HfSource(NamedTuple):
    """Where one checkpoint tensor comes from in the model's own state (JSON: a list)."""

    name: str | None
    """The `state_dict` name holding it; None for a constant zero tensor of ``zeros``."""
    index: int | None = None
    """Its index along dim 0 when it is one expert of a stacked parameter."""
    scale: float = 1.0
    """Times this (a power of two, so exact)."""
    zeros: tuple[int, ...] | None = None


def hf_layout(model: MoETransformer) -> dict[str, HfSource]:
    """Hugging Face name -> its `HfSource` for every tensor `save_hf` writes: how a consumer
    of the model's own state (a weight stream) writes the checkpoint's tensors without
    knowing this model."""
    owner = {id(t): name for name, t in model.state_dict(keep_vars=True).items()}
    layout: dict[str, HfSource] = {}
    for hf_name, t in hf_tensors(model).items():
        if id(t) in owner:
            layout[hf_name] = HfSource(owner[id(t)])
            continue
        base = t._base
        if base is None or id(base) not in owner:
            raise MoEDeterminismError(f"{hf_name}: not a parameter nor a slice of one")
        offset = t.data_ptr() - base.data_ptr()
        layout[hf_name] = HfSource(
            owner[id(base)], offset // (base.stride(0) * base.element_size())
        )
    for p in _shared_expert_layers(model):
        down = layout[p + SHARED_DOWN]
        layout[p + SHARED_DOWN] = down._replace(scale=SHARED_DOWN_SCALE)
        hidden = model.config.hidden_size
        layout[p + SHARED_GATE] = HfSource(None, zeros=(1, hidden))
    return layout


def _copied(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.detach().contiguous().clone() for k, v in tensors.items()}


def hf_state_dict(model: MoETransformer) -> dict[str, torch.Tensor]:
    """A detached copy of every tensor `save_hf` writes, under its Hugging Face name."""
    return _copied(checkpoint_tensors(model))


def _shards(
    tensors: dict[str, torch.Tensor], max_shard_bytes: int | None
) -> list[dict[str, torch.Tensor]]:
    """Tensors in name order, cut into shards of at most ``max_shard_bytes`` (a tensor larger
    than that gets a shard of its own)."""
    if max_shard_bytes is None:
        return [tensors]
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name in sorted(tensors):
        t = tensors[name]
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    return shards


def save_hf(
    model: MoETransformer, directory: str | Path, *, max_shard_bytes: int | None = None
) -> Path:
    """Write config.json and the weights; returns the directory.

    One ``model.safetensors`` by default; with ``max_shard_bytes``, shards
    ``model-0000i-of-0000n.safetensors`` and ``model.safetensors.index.json`` once the weights
    exceed it. Weight files of an earlier save in the directory are removed first, so a
    loader never mixes two checkpoints.
    """
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    for old in [*path.glob("model*.safetensors"), path / INDEX_FILE]:
        old.unlink(missing_ok=True)
    dtype = next(model.parameters()).dtype
    (path / "config.json").write_text(json.dumps(to_hf_config(model.config, dtype), indent=2))
    # copies are made shard by shard (safetensors wants tensors that share no memory, and
    # the experts are views of one stacked parameter): the host holds one shard extra
    shards = _shards(checkpoint_tensors(model), max_shard_bytes)
    if len(shards) == 1:
        save_file(_copied(shards[0]), str(path / SINGLE_FILE), metadata={"format": "pt"})
        return path
    weight_map: dict[str, str] = {}
    total = 0
    for i, shard in enumerate(shards, start=1):
        name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(_copied(shard), str(path / name), metadata={"format": "pt"})
        for k, t in shard.items():
            weight_map[k] = name
            total += t.numel() * t.element_size()
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (path / INDEX_FILE).write_text(json.dumps(index, indent=2))
    return path


def _weight_files(path: Path) -> dict[str, list[str]]:
    """Shard file -> tensor names to read from it (the index's map if there is one)."""
    index = path / INDEX_FILE
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError, TypeError):
            raise MoEDeterminismError(f"{index}: not a safetensors index (no weight_map)") from None
        files: dict[str, list[str]] = {}
        for name, file in weight_map.items():
            files.setdefault(file, []).append(name)
        absent = sorted(f for f in files if not (path / f).exists())
        if absent:
            raise MoEDeterminismError(f"{index} names shards that are missing: {absent[:3]}")
        return files
    found = sorted(path.glob("*.safetensors"))
    if not found:
        raise MoEDeterminismError(
            f"{path}: no model.safetensors, {INDEX_FILE} or other *.safetensors file"
        )
    out = {}
    for f in found:
        with safe_open(str(f), framework="pt") as sf:
            out[f.name] = list(sf.keys())
    return out


def read_config(directory: str | Path) -> MoEConfig:
    """The `MoEConfig` of a Hugging Face model directory (checked, see `hf_config`)."""
    return config_from_dir(directory)


def load_hf(
    directory: str | Path, dtype: torch.dtype | None = None, *, config: MoEConfig | None = None
) -> MoETransformer:
    """Build a `MoETransformer` from a model directory of a supported family (config.json +
    safetensors, sharded with an index or not), streaming tensor by tensor.

    ``config``: build with this config instead (a run's, with its own ``path`` and
    ``kv_split_size``); its other fields must be the directory's."""
    path = Path(directory).expanduser()
    # the model is its weights: where they were read from is the caller's to record
    cfg = msgspec.structs.replace(read_config(path), path="")
    if config is not None:
        mine = msgspec.structs.replace(config, path="", kv_split_size=cfg.kv_split_size)
        if mine != cfg:
            raise MoEDeterminismError(f"{path}: config.json describes another model than {config}")
        cfg = config
    files = _weight_files(path)
    with torch.device("meta"):
        model = MoETransformer(cfg)
    targets = hf_tensors(model)
    available = {name for names in files.values() for name in names}
    missing = sorted(set(targets) - available)
    if missing:
        raise MoEDeterminismError(
            f"{path}: missing tensors, e.g. {missing[:3]} ({len(missing)} in all)"
        )
    if dtype is None:  # the checkpoint's own dtype, read from its embedding
        file = next(f for f, names in files.items() if "model.embed_tokens.weight" in names)
        with safe_open(str(path / file), framework="pt") as sf:
            dtype = sf.get_tensor("model.embed_tokens.weight").dtype
    model = model.to(dtype).to_empty(device="cpu")
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    targets = hf_tensors(model)
    with torch.no_grad():
        for file, names in files.items():
            with safe_open(str(path / file), framework="pt") as sf:
                for name in names:
                    target = targets.get(name)
                    if target is None:
                        continue  # e.g. lm_head.weight of a tied checkpoint
                    t = sf.get_tensor(name)
                    if t.shape != target.shape:
                        raise MoEDeterminismError(
                            f"{path / file}: {name} has shape {tuple(t.shape)}, config.json "
                            f"implies {tuple(target.shape)}"
                        )
                    target.copy_(t)
    _ungate_shared_experts(model, targets, path, files)
    return model


def _ungate_shared_experts(
    model: MoETransformer,
    targets: dict[str, torch.Tensor],
    path: Path,
    files: dict[str, list[str]],
) -> None:
    """Undo `checkpoint_tensors`' gate for every shared expert written with one: the gate must
    be the zero one (this layout has no gate to put another in), the down projection halved.
    A shared expert without a gate (an older tandem checkpoint) was written as it is."""
    where = {name: file for file, names in files.items() for name in names}
    for p in _shared_expert_layers(model):
        if p + SHARED_GATE not in where:
            continue
        with safe_open(str(path / where[p + SHARED_GATE]), framework="pt") as sf:
            gate = sf.get_tensor(p + SHARED_GATE)
        if gate.shape != (1, model.config.hidden_size) or bool(gate.any()):
            raise MoEDeterminismError(
                f"{path}: {p + SHARED_GATE} is not the zero gate tandem writes (shape "
                f"{tuple(gate.shape)}, {int(gate.count_nonzero())} non-zero): this layout's "
                "shared expert has no gate, so only a checkpoint written by tandem's save_hf "
                "(or with a zero gate) loads"
            )
        down = targets[p + SHARED_DOWN]
        with torch.no_grad():
            down.div_(SHARED_DOWN_SCALE)
