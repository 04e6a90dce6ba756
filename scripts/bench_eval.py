#!/usr/bin/env python3
"""Loglikelihood requests per second of tpu-llm's lm-eval backend (TpuLM) against lm-eval's own `hf` backend
on the same random GPT-2 (4 layers of width 256, a 256-token context, 300 token ids; needs the reference and
eval extras), on this machine's CPU (docs/evaluation.md, "Speed"):

    python scripts/bench_eval.py ours     # TpuLM on the imported run
    python scripts/bench_eval.py hf       # lm-eval's HFLM on the Hugging Face directory (PyTorch)

256 requests (contexts of 8 to 199 tokens, continuations of 1 to 7), batch size 16, scored twice: the first
pass includes XLA's compilation of one program per length bucket, the second is the steady state. The model
is written once to DIR (default: tpu-llm-bench-eval in the system's temporary folder) and reused.
"""

import contextlib
import io
import os
import random
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))


def requests(n: int = 256, seed: int = 0) -> list:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        context, continuation = rng.randrange(8, 200), rng.randrange(1, 8)
        ids = [rng.randrange(1, 299) for _ in range(context + continuation)]
        out.append((None, ids[:context], ids[context:]))
    return out


def model_dirs(root: str) -> tuple[str, str]:
    hf_dir, run_dir = os.path.join(root, "gpt2"), os.path.join(root, "gpt2-run")
    if not os.path.exists(run_dir):
        import torch
        import transformers
        from helpers import write_bpe_tokenizer

        from tpu_llm import cli

        torch.manual_seed(0)
        transformers.GPT2LMHeadModel(transformers.GPT2Config(
            vocab_size=300, n_positions=256, n_embd=256, n_layer=4, n_head=4, bos_token_id=0, eos_token_id=0)
        ).save_pretrained(hf_dir)
        write_bpe_tokenizer(hf_dir)
        with contextlib.redirect_stdout(io.StringIO()):
            assert cli.main(["import", "--from", hf_dir, "--run_dir", run_dir]) == 0
    return hf_dir, run_dir


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in ("ours", "hf") or len(argv) > 2:
        print(__doc__.strip().splitlines()[0], "\nusage: bench_eval.py ours|hf [DIR]", file=sys.stderr)
        return 2
    hf_dir, run_dir = model_dirs(argv[1] if len(argv) > 1 else os.path.join(tempfile.gettempdir(), "tpu-llm-bench-eval"))
    if argv[0] == "ours":
        from tpu_llm.eval.backend import TpuLM

        lm = TpuLM.from_run(run_dir, batch_size=16)
    else:
        from lm_eval.models.huggingface import HFLM

        lm = HFLM(pretrained=hf_dir, device="cpu", batch_size=16, dtype="float32")
    batch = requests()
    for name in ("first pass (with compilation)", "second pass"):
        start = time.time()
        lm._loglikelihood_tokens(batch, disable_tqdm=True)
        seconds = time.time() - start
        print(f"{argv[0]:<5} {name:<30} {len(batch) / seconds:6.1f} requests/s ({seconds:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
