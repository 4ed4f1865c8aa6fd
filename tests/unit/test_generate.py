"""fsdp2d generate: a checkpoint (saved with its model spec) sampled on one process."""

import torch

from fsdp2d import checkpoint
from fsdp2d.models import Llama, LlamaArgs
from fsdp2d.hf.weights import model_spec
from fsdp2d.train.cli import main
from fsdp2d.train.generate import load_model, sample


def test_greedy_generation_follows_the_model(tmp_path, capsys):
    torch.manual_seed(0)
    model = Llama(LlamaArgs(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=256, multiple_of=8,
                            max_seq_len=16, rope_theta=10000.0))
    ckpt = tmp_path / "run" / "checkpoints" / "step_00000001"
    checkpoint.save(ckpt, model, extra={"model": model_spec(model)})
    loaded = load_model(ckpt)
    prompt = list(b"def ")
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(20):  # greedy by hand, context cut to the RoPE table's 16 rows
            ids.append(int(model(torch.tensor([ids[-16:]]))[0, -1].argmax()))
    assert sample(loaded, prompt, 20, temperature=0) == ids
    a, b = (sample(loaded, prompt, 10, temperature=1.0, seed=s) for s in (1, 2))
    assert a[:4] == prompt and a != b and sample(loaded, prompt, 10, temperature=1.0, seed=1) == a
    assert main(["generate", str(ckpt), "--prompt", "def ", "--max-new-tokens", "20", "--temperature", "0"]) == 0
    assert capsys.readouterr().out == bytes(ids).decode(errors="replace") + "\n"


def test_bad_arguments_are_one_line(tmp_path, capsys):
    """Issue 21: bad arguments used to end in tracebacks from deep inside sampling."""
    import pytest

    torch.manual_seed(0)
    model = Llama(LlamaArgs(dim=16, n_layers=1, n_heads=2, vocab_size=64, multiple_of=8, max_seq_len=8))
    ckpt = tmp_path / "ckpt"
    checkpoint.save(ckpt, model)  # no extra: the spec save records is enough
    for flag, value in (("--max-new-tokens", "-1"), ("--top-k", "-2"), ("--temperature", "nan")):
        with pytest.raises(SystemExit):
            main(["generate", str(ckpt), flag, value])
        assert f"{flag}=" in capsys.readouterr().err
    for argv, words in (([str(tmp_path / "nope")], "nope"), ([str(ckpt), "--prompt", ""], "no tokens"),
                        ([str(ckpt), "--prompt", "zz"], "vocabulary (64)"),
                        ([str(ckpt), "--tokenizer", str(tmp_path / "tok.json")], "tok.json")):
        assert main(["generate", *argv]) == 1, argv
        err = capsys.readouterr().err
        assert err.startswith("error: ") and err.count("\n") == 1 and words in err, (argv, err)
