"""Issue 25: what torchtitan's own `Trainer` needs on disk and on a CPU, made by the test and the bench
(tests/test_torchtitan_trainer.py, bench/torchtitan_trainer.py; no downloads).

- `make_assets(dir)`: a byte-level BPE tokenizer (`tokenizers`, trained here on the text below) saved as
  `tokenizer.json` + `tokenizer_config.json` (bos/eos) in `dir/tokenizer` (torchtitan's `hf_assets_path`),
  and a tiny text data set `dir/data/train.jsonl` ({"text": ...} lines) that torchtitan's `c4_test` loader
  (`load_dataset(path, split="train")`) reads as a local path (`dataloader.dataset_path`).
- `sdcwatch_tiny()`: a torchtitan config-registry function, named as a user names theirs
  (`--module bench.titan_tiny --config sdcwatch_tiny`): a tiny llama3 flavour (2 layers, dim 64; or
  torchtitan's `debugmodel` with TITAN_TINY_FLAVOR=debugmodel), HSDP over the world's ranks as replicas
  (`data_parallel_replicate_degree=WORLD_SIZE`), and `checkpoint=SdcwatchCheckpointer.Config(...)`
  (torchtitan's own `CheckpointManager.Config()` with TITAN_TINY_SDCWATCH=0: the bench's baseline). The
  paths, the job and the step counts come from the environment (TITAN_TINY_*); TITAN_TINY_DEVICE=cuda keeps
  FlexAttention.
- `run_on_cpu()`: the CPU shim, and `torch_compat()`: one torch 2.13.0 gap; see their docstrings.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

VOCAB = 320
SEQ_LEN = 32

_WORDS = ("silent data corruption flips a bit in a weight and the loss goes on as if nothing happened "
          "the replicas vote on their fingerprints and the odd one out is rolled back to a verified "
          "checkpoint held in the agent's memory while training goes on").split()


def make_assets(root: Path) -> tuple[Path, Path]:
    """The tokenizer folder and the data set folder (see the module docstring)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    lines = [" ".join(_WORDS[(i * 7 + j * 3) % len(_WORDS)] for j in range(12 + i % 9)) for i in range(400)]
    tok_dir, data_dir = root / "tokenizer", root / "data"
    tok_dir.mkdir(parents=True, exist_ok=True)
    data_dir.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(lines, trainer)
    tok.save(str(tok_dir / "tokenizer.json"))
    (tok_dir / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    with open(data_dir / "train.jsonl", "w") as f:
        f.writelines(json.dumps({"text": line}) + "\n" for line in lines)
    return tok_dir, data_dir


def run_on_cpu() -> None:
    """Make torchtitan 0.3.0 run its device code on the CPU. Called in a rank before torchtitan is imported.

    torchtitan has no setting for the device: `torchtitan/tools/utils.py` (`get_device_info`, line 55) sets
    the module globals `device_type = _get_available_device_type() or "cuda"` and `device_module =
    torch.cuda` at import, and the trainer (`trainer.py` line 297: `device_module.set_device`), the process
    group's backend (`distributed/utils.py` `_get_distributed_backend`: nccl unless the device type maps to
    another), the device mesh (`distributed/parallel_dims.py` line 282), the barrier after the first step
    (`distributed/utils.py` line 586: `barrier(device_ids=[device_module.current_device()])`) and the memory
    monitor (`components/metrics.py` `DeviceMemoryMonitor`) read those globals, most of them imported by
    name. This shim sets the two globals right after `torchtitan.tools.utils` is imported and before any
    module that imports them is: `device_type = "cpu"` (so gloo from `Backend.default_device_backend_map`, a
    CPU mesh, CPU tensors) and `device_module` = torch.cpu plus what torch.cpu lacks or answers differently:
    `current_device()` is 0 (torch.cpu's is the string "cpu", which the barrier's device_ids refuses) and
    the memory monitor's `get_device_name`, `get_device_properties`, `reset_peak_memory_stats`,
    `empty_cache`, `memory_stats` (a name, the host's memory, no-ops, empty stats: the monitor only logs
    them). Nothing else of torchtitan is replaced."""
    import sys

    import torch

    early = [m for m in ("torchtitan.trainer", "torchtitan.distributed.utils",
                         "torchtitan.components.metrics") if m in sys.modules]
    assert not early, f"run_on_cpu() must run before torchtitan is imported: {early}"
    import torchtitan.tools.utils as tt_utils

    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    shim = SimpleNamespace(
        **{name: getattr(torch.cpu, name) for name in dir(torch.cpu) if not name.startswith("_")})
    shim.__dict__.update(
        current_device=lambda: 0, get_device_name=lambda device=None: "cpu",
        get_device_properties=lambda device=None: SimpleNamespace(total_memory=total),
        reset_peak_memory_stats=lambda device=None: None, empty_cache=lambda: None,
        memory_stats=lambda device=None: {})
    tt_utils.device_type, tt_utils.device_module = "cpu", shim


def torch_compat() -> None:
    """torchtitan 0.3.0 is written against PyTorch nightly; torch 2.13.0 lacks one function the trainer calls
    after its first step, on any device: `torch.distributed.set_timeout(timeout, group)`
    (`torchtitan/distributed/utils.py` line 595, `set_pg_timeouts`). torch 2.13.0 has it under its private
    name `torch.distributed.distributed_c10d._set_pg_timeout(timeout, group)` (same arguments, gloo and
    nccl); this names it, if it is missing. Needed on a GPU too with torch 2.13.0."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    if not hasattr(dist, "set_timeout"):
        dist.set_timeout = distributed_c10d._set_pg_timeout


def tiny_llama3(cpu: bool = True) -> Any:
    """A llama3 flavour small enough for a CPU test (torchtitan's smallest, `debugmodel`, is dim 256 with 6
    layers and a 2048 vocabulary): 2 layers, dim 64, 4 heads, the tokenizer's vocabulary, built with
    torchtitan's own llama3 helpers. `attn_backend="flex"` builds FlexAttention, whose backward torch has
    not on the CPU (torch/nn/attention/flex_attention.py `_validate_device`: "FlexAttention does not support
    backward on CPU"), and "varlen" is CUDA-only; so on the CPU each layer's inner attention is swapped to
    `ScaledDotProductAttention` (causal, no per-document mask), as torchtitan's own graph_trainer tests do
    (experiments/graph_trainer/common_utils.py)."""
    import dataclasses

    from torchtitan.models import llama3
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm, compute_ffn_hidden_dim
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.llama3 import Llama3Model, model_registry

    dim, heads, layers = 64, 4, 2
    model = Llama3Model.Config(
        dim=dim, vocab_size=VOCAB,
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=dim,
                                        param_init=llama3._EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=dim, param_init=llama3._NORM_INIT),
        lm_head=Linear.Config(in_features=dim, out_features=VOCAB,
                              param_init=llama3._output_linear_init(dim)),
        layers=llama3._build_llama3_layers(
            fuse_qkv=True, n_layers=layers, dim=dim, n_heads=heads,
            hidden_dim=compute_ffn_hidden_dim(dim, multiple_of=64),
            rope=ComplexRoPE.Config(dim=dim // heads, max_seq_len=8192, theta=500000, scaling="llama"),
            attn_backend="flex"))
    if cpu:
        for layer in model.layers:
            layer.attention.inner_attention = ScaledDotProductAttention.Config()
    return dataclasses.replace(model_registry("debugmodel"), flavor="sdcwatch_tiny", model=model)


def sdcwatch_tiny() -> Any:
    """The config-registry function (see the module docstring)."""
    from torchtitan.components.loss import CrossEntropyLoss
    from torchtitan.components.metrics import MetricsProcessor
    from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw
    from torchtitan.components.checkpoint import CheckpointManager
    from torchtitan.config import CommConfig, DebugConfig, ParallelismConfig, TrainingConfig
    from torchtitan.hf_datasets.text_datasets import HuggingFaceTextDataLoader
    from torchtitan.trainer import Trainer

    from integrations.torchtitan import SdcwatchCheckpointer

    env = os.environ
    cpu = env.get("TITAN_TINY_DEVICE", "cpu") == "cpu"
    if env.get("TITAN_TINY_FLAVOR", "tiny") == "debugmodel":
        from torchtitan.models.llama3 import model_registry
        model_spec = model_registry("debugmodel")
        vocab = model_spec.model.vocab_size
    else:
        model_spec, vocab = tiny_llama3(cpu), VOCAB
    if env.get("TITAN_TINY_SDCWATCH", "1") == "1":
        checkpoint: Any = SdcwatchCheckpointer.Config(job_id=env["TITAN_TINY_JOB"],
                                                      sdcwatch_interval=int(env["TITAN_TINY_SAVE_EVERY"]),
                                                      sdcwatch_resume=env.get("TITAN_TINY_RESUME") == "1")
    else:
        checkpoint = CheckpointManager.Config()
    return Trainer.Config(
        model_spec=model_spec,
        hf_assets_path=env["TITAN_TINY_TOKENIZER"],
        dump_folder=env["TITAN_TINY_DUMP"],
        loss=CrossEntropyLoss.Config(global_vocab_size=vocab),
        optimizer=default_adamw(lr=3e-3),
        lr_scheduler=LRSchedulersContainer.Config(warmup_steps=2),
        training=TrainingConfig(local_batch_size=int(env.get("TITAN_TINY_BATCH", "2")),
                                seq_len=int(env.get("TITAN_TINY_SEQ", str(SEQ_LEN))),
                                steps=int(env["TITAN_TINY_STEPS"]),
                                mixed_precision_param="float32", disable_cuda_graphs=True),
        dataloader=HuggingFaceTextDataLoader.Config(dataset="c4_test", dataset_path=env["TITAN_TINY_DATA"]),
        metrics=MetricsProcessor.Config(log_freq=1),
        parallelism=ParallelismConfig(data_parallel_replicate_degree=int(env.get("WORLD_SIZE", "1")),
                                      data_parallel_shard_degree=1,
                                      spmd_backend="partial_dtensor"),
        comm=CommConfig(train_timeout_seconds=600),
        checkpoint=checkpoint,
        debug=DebugConfig(deterministic=env.get("TITAN_TINY_DETERMINISTIC") == "1"),
    )
