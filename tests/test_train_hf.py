"""The launcher from a Hugging Face folder to a Hugging Face export (one torchrun job).

``fsdp2d train --model.init_from=HF`` on the 2 x 2 mesh of configs/debug_cpu.toml, two
steps at lr 1e-7, then the run's ``hf/`` export loaded by ``transformers``. The HF
Llama has a tied head, kept tied through TP and fully_shard. Checks: the export's
logits equal the original model's to 1e-4 relative (two Adam steps of ~1e-7 move the
weights by ~2e-7, far below that; a model that was not loaded from the folder, or an
export that misplaces a tensor, is O(1) off), and its config is still tied.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from . import hf_models as H

T = pytest.importorskip("transformers")
ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.dist
def test_init_from_hf_train_export(tmp_path):
    torch.manual_seed(0)
    cfg = T.LlamaConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, vocab_size=256, max_position_embeddings=64, initializer_range=0.2,
                        tie_word_embeddings=True)
    T.LlamaForCausalLM(cfg).save_pretrained(tmp_path / "hf_in")
    args = ["--config", str(ROOT / "configs" / "debug_cpu.toml"), f"--model.init_from={tmp_path / 'hf_in'}",
            "--data.seq_len=32", "--training.steps=2", "--training.global_batch=4", "--training.eval_every=0",
            "--optim.lr=1e-7", "--optim.warmup_steps=1", "--checkpoint.every=0", f"--metrics.runs_dir={tmp_path}",
            "--metrics.run_name=run"]
    proc = subprocess.run([sys.executable, "-m", "fsdp2d.train", *args], capture_output=True, text=True,
                          timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = tmp_path / "run" / "hf"
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is True
    from safetensors import safe_open

    with safe_open(str(out / "model.safetensors"), "pt") as f:  # one tensor: the run kept it tied
        assert "lm_head.weight" not in set(f.keys()) and "model.embed_tokens.weight" in set(f.keys())
    x = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    err = H.rel_err(H.hf_logits(out, x), H.hf_logits(tmp_path / "hf_in", x))
    assert err < 1e-4, f"export vs the HF model it started from: rel error {err:.2e}"
