"""lm-evaluation-harness on a run (tpu_llm/eval/, `tpu-llm eval`; issue 49) against lm-eval's own `hf` backend.

A tiny random GPT-2, Llama (its tokenizer putting BOS in front, as Llama's does) and Qwen2 are saved with transformers and imported (tests/hf_reference.py's `build`); the local
tasks of tests/data/eval_tasks (multiple choice, rolling perplexity, greedy generation; JSON lines read by
`datasets`, no network) are evaluated with lm-eval's HFLM on the HF directory (torch, CPU) and with TpuLM on the
run. Every request's loglikelihood agrees within 1e-4 (a rolling sum within 1e-4 relative) with the same
is_greedy, every generation is the same text, and so every metric is the same.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from unittest import mock

import pytest

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # local JSON files only; before `datasets` is imported
lm_eval = pytest.importorskip("lm_eval", reason="the evaluation tests need lm-eval: pip install -e '.[eval]'")
from helpers import write_bpe_tokenizer  # noqa: E402
from hf_reference import build, torch, transformers  # noqa: E402  (skips without torch and transformers)

from tpu_llm import cli  # noqa: E402
from tpu_llm.errors import UserError  # noqa: E402
from tpu_llm.eval import require_lm_eval  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
TASKS_DIR = "tests/data/eval_tasks"  # the YAML's data_files are relative to the repository
TASKS = ["tiny_choice", "tiny_ppl", "tiny_gen"]


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    import datasets

    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.chdir(REPO)


def write_bos_tokenizer(folder) -> None:
    """write_bpe_tokenizer's tokenizer with a post-processor that puts BOS in front of every text, as Llama's."""
    from tokenizers import Tokenizer, processors

    write_bpe_tokenizer(folder)
    path = os.path.join(folder, "tokenizer.json")
    tok = Tokenizer.from_file(path)
    bos = ("<|endoftext|>", tok.token_to_id("<|endoftext|>"))
    tok.post_processor = processors.TemplateProcessing(single="<|endoftext|> $A", pair="<|endoftext|> $A $B",
                                                       special_tokens=[bos])
    tok.save(path)


def evaluate_both(family: str, root: Path, bos: bool = False) -> dict:
    """lm-eval's results with samples for TASKS, from HFLM on the HF directory and TpuLM on the imported run;
    `bos`: the tokenizer puts BOS in front of each text (lm-eval encodes with the tokenizer's special tokens)."""
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    from tpu_llm.eval.backend import TpuLM

    os.chdir(REPO)
    made = build(family, root, dtypes=("float32",), tokenizer=write_bos_tokenizer if bos else write_bpe_tokenizer)["float32"]
    manager = TaskManager(include_path=TASKS_DIR, include_defaults=False)  # ~15 s less
    ours = TpuLM.from_run(made["run_dir"], batch_size=8)
    # the directory's tokenizer.json as it is (AutoTokenizer would give Qwen2's class, which rebuilds the
    # pre-tokenizer of this GPT-2-style test tokenizer); the bos and eos tokens from tokenizer_config.json
    tokenizer = transformers.PreTrainedTokenizerFast.from_pretrained(made["hf_dir"])
    reference = HFLM(pretrained=made["hf_dir"], tokenizer=tokenizer, device="cpu", batch_size=4, dtype="float32")
    out = {"dirs": made, "ours": ours, "reference": reference}
    for name, lm in (("ours", ours), ("reference", reference)):
        out[f"{name}_results"] = lm_eval.simple_evaluate(model=lm, tasks=TASKS, task_manager=manager, log_samples=True)
    return out


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory):
    return evaluate_both("gpt2", tmp_path_factory.mktemp("eval_gpt2"))


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return evaluate_both("llama", tmp_path_factory.mktemp("eval_llama"), bos=True)


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory):
    return evaluate_both("qwen2", tmp_path_factory.mktemp("eval_qwen2"))


def close(a: float, b: float, relative: bool = False) -> bool:
    return abs(a - b) <= 1e-4 * (max(1.0, abs(b)) if relative else 1.0)


@pytest.mark.parametrize("family", ["gpt2", "llama", "qwen2"])
def test_every_request_and_metric_equals_lm_evals_hf_backend(family, request):
    run = request.getfixturevalue(family)
    bos = run["reference"].tokenizer.bos_token_id
    assert (run["ours"].tok_encode("a")[0] == bos) == (family == "llama")  # Llama's tokenizer puts BOS in front
    ours, ref = run["ours_results"], run["reference_results"]
    for task in TASKS:
        mine, theirs = ours["samples"][task], ref["samples"][task]
        assert len(mine) == len(theirs) > 0, task
        for a, b in zip(mine, theirs):
            assert a["arguments"] == b["arguments"], task  # the same requests
            for (got,), (want,) in zip(a["resps"], b["resps"]):
                if task == "tiny_choice":  # (loglikelihood, is_greedy)
                    assert close(got[0], want[0]) and got[1] == want[1], (task, got, want)
                elif task == "tiny_ppl":  # a sum over rolling windows
                    assert close(got, want, relative=True), (task, got, want)
                else:  # greedy text, cut at `until`
                    assert got == want, (task, got, want)
        for metric, value in theirs_metrics(ref, task).items():
            got = ours["results"][task][metric]
            assert close(got, value, relative=True) if "perplexity" in metric or "bits" in metric else got == value, \
                (task, metric, got, value)
    # the perplexity texts are longer than one window of max_len (64) tokens: rolling windows were used
    assert max(len(run["ours"].tok_encode(s["arguments"][0][0])) for s in ours["samples"]["tiny_ppl"]) > 64


def test_scoring_split_over_replicas_gives_every_request_the_one_device_numbers(gpt2):
    # data parallel: 2 logical CPU replicas (MirroredStrategy), 3 rows each per call (6 at once: the last call
    # padded with empty rows); every request's loglikelihood within 1e-5 of the one-device run's, with the same
    # is_greedy, every rolling sum within 1e-5 relative, every generation the same text (on one device)
    import tensorflow as tf
    from lm_eval.tasks import TaskManager

    from tpu_llm.eval.backend import TpuLM

    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    ours = TpuLM.from_run(gpt2["dirs"]["run_dir"], batch_size=3, strategy=strategy)
    assert ours.replicas == 2 and len(ours.model.weights[0].value.values) == 2  # a copy of the weights on each device
    results = lm_eval.simple_evaluate(model=ours, tasks=TASKS, log_samples=True,
                                      task_manager=TaskManager(include_path=TASKS_DIR, include_defaults=False))
    one = gpt2["ours_results"]
    for task in TASKS:
        for a, b in zip(results["samples"][task], one["samples"][task], strict=True):
            for (got,), (want,) in zip(a["resps"], b["resps"], strict=True):
                if task == "tiny_choice":
                    assert abs(got[0] - want[0]) <= 1e-5 and got[1] == want[1], (got, want)
                elif task == "tiny_ppl":
                    assert abs(got - want) <= 1e-5 * abs(want), (got, want)
                else:
                    assert got == want, (got, want)


def test_cli_scores_over_the_logical_cpus_it_is_given(gpt2, tmp_path, capsys):
    out = tmp_path / "results.json"
    assert cli.main(["eval", "--run_dir", gpt2["dirs"]["run_dir"], "--tasks", "tiny_choice", "--include_path",
                     TASKS_DIR, "--limit", "4", "--batch_size", "1", "--cpu_devices", "2", "--output", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "devices   2 replicas (strategy=auto: cpu_devices=2 logical CPU devices): the requests" in printed, printed
    first4 = [s["acc"] for s in gpt2["reference_results"]["samples"]["tiny_choice"][:4]]
    assert json.loads(out.read_text())["results"]["tiny_choice"]["acc,none"] == pytest.approx(sum(first4) / 4)


def theirs_metrics(results: dict, task: str) -> dict:
    return {k: v for k, v in results["results"][task].items() if k != "alias" and "stderr" not in k}


def test_greedy_continuations_are_greedy_in_both(gpt2):
    """Continuations that are the model's own argmax tokens (so is_greedy is True), scored with the context cut
    from the left past max_len, as lm-eval's hf backend cuts it."""
    ours, reference = gpt2["ours"], gpt2["reference"]
    model = reference.model
    requests = []
    for length in (3, 20, 70):  # 70 + 3 > max_len + 1: the context loses tokens from the left
        context = [(7 * i + length) % 290 + 1 for i in range(length)]
        ids = list(context)
        with torch.no_grad():
            for _ in range(3):
                ids.append(int(model(torch.tensor([ids[-64:]])).logits[0, -1].argmax()))
        requests += [(None, context, ids[length:]), (None, context, [ids[length] + 1, 5])]
    notes = []
    ours.say, ours._truncated = notes.append, False
    got, want = ours._loglikelihood_tokens(requests), reference._loglikelihood_tokens(requests)
    assert [g for _, g in got] == [g for _, g in want]
    assert [g for _, g in got][:4] == [True, False] * 2  # cut from the left, the argmax saw another context
    assert all(close(a, b) for (a, _), (b, _) in zip(got, want)), (got, want)
    assert len(notes) == 1 and "dropped from the left" in notes[0]  # said once


def test_generation_in_chunks_stops_early_and_gives_the_same_texts(gpt2):
    """generate_until asks the sampler for a few tokens at a time and stops once an `until` string shows: the
    texts are still lm-eval's hf backend's (its greedy texts cut at a stop string taken from their middle)."""
    from lm_eval.api.instance import Instance

    ours, requests, expected = gpt2["ours"], [], []
    for sample in gpt2["reference_results"]["samples"]["tiny_gen"]:
        context, kwargs = sample["arguments"][0]
        text = sample["resps"][0][0]
        assert len(text) >= 8, text
        stop = text[4:6]
        requests.append(Instance(request_type="generate_until", doc={}, idx=0,
                                 arguments=(context, {**kwargs, "until": [*kwargs["until"], stop]})))
        expected.append(text.split(stop)[0])
    calls = []
    generate = ours._sampler.generate
    with mock.patch.object(ours._sampler, "generate", lambda *a, **k: calls.append(a[1]) or generate(*a, **k)):
        ours.gen_chunk = 3
        try:
            texts = ours.generate_until(requests, disable_tqdm=True)
        finally:
            ours.gen_chunk = 32
    assert texts == expected
    assert set(calls) <= {3, 1} and len(calls) < 6 * len(requests)  # 16 tokens a request: 6 calls unless stopped


def test_generation_longer_than_the_context_is_one_line(gpt2):
    from lm_eval.api.instance import Instance

    request = Instance(request_type="generate_until", doc={}, idx=0,
                       arguments=("Hello", {"until": ["\n"], "max_gen_toks": 64, "do_sample": False}))
    with pytest.raises(UserError, match=r"^a task asks for up to 64 new tokens \(its max_gen_toks\), which leaves no "
                                        r"room for its prompt in this model's max_len=64"):
        gpt2["ours"].generate_until([request], disable_tqdm=True)


def test_cli_prints_lm_evals_table_and_writes_its_json(gpt2, tmp_path, capsys):
    out = tmp_path / "results.json"
    assert cli.main(["eval", "--run_dir", gpt2["dirs"]["run_dir"], "--tasks", "tiny_choice", "--include_path",
                     TASKS_DIR, "--limit", "4", "--batch_size", "4", "--output", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "|tiny_choice|" in printed and "acc_norm" in printed and f"wrote     {out}" in printed
    saved = json.loads(out.read_text())
    assert saved["n-samples"]["tiny_choice"] == {"original": 8, "effective": 4} and "samples" not in saved
    first4 = [s["acc"] for s in gpt2["reference_results"]["samples"]["tiny_choice"][:4]]
    assert saved["results"]["tiny_choice"]["acc,none"] == pytest.approx(sum(first4) / 4)


def test_python_api_evaluate_gives_the_same_numbers(gpt2):
    import tpu_llm

    results = tpu_llm.load(gpt2["dirs"]["run_dir"]).evaluate(["tiny_choice"], include_path=TASKS_DIR, limit=4,
                                                             batch_size=4)
    first4 = [s["acc"] for s in gpt2["reference_results"]["samples"]["tiny_choice"][:4]]
    assert results["results"]["tiny_choice"]["acc,none"] == pytest.approx(sum(first4) / 4)


def lora_model(imported: str, base_dtype: str = "float32"):
    """(config, model): the imported GPT-2 run's weights under random LoRA adapters on every PEFT target, the frozen
    base stored as `base_dtype` (train.lora_base_dtype). The adapters are seeded: the same for every base dtype
    (and B is not zero, as it starts, where the adapters would change nothing)."""
    import numpy as np

    from tpu_llm.config import load_config
    from tpu_llm.model import GPT
    from tpu_llm.model import adapters as lora
    from tpu_llm.model import families
    from tpu_llm.training.checkpoint import load_for_generation

    base, _, cfg = load_for_generation(imported)
    cfg = load_config(None, {"train.lora_rank": 2, "train.lora_alpha": 4.0, "train.lora_base_dtype": base_dtype,
                             "train.lora_targets": ",".join(families.get("gpt2").peft_targets)}, base=cfg)
    model = GPT(cfg.model, cfg.model.vocab_size, lora.adapters_for(cfg)).build_weights()
    lora.copy_base(base, model)
    rng = np.random.default_rng(5)
    for layer in lora.adapted(model):
        for weights in (layer.lora_a, layer.lora_b):
            weights.assign(rng.normal(0, 0.2, tuple(weights.shape)).astype(np.float32))
    return cfg, model


def save_run(imported: str, run: Path, cfg, model) -> Path:
    """A copy of the imported run's directory holding `model` under `cfg`, a checkpoint as training leaves it."""
    from tpu_llm.training.checkpoint import Checkpointer

    shutil.copytree(imported, run, ignore=shutil.ignore_patterns("checkpoints"))
    (run / "config.yaml").write_text(cfg.to_yaml())
    Checkpointer(str(run), keep=1, model_config=cfg.model, model=model).save(0)
    return run


def test_a_lora_run_evaluates_as_its_merged_copy(gpt2, tmp_path):
    """A LoRA run (random adapters on the imported GPT-2, a checkpoint as training leaves it) scores every request
    as its copy with the adapters merged in (`tpu-llm export --format run`) does, and not as the base does."""
    from tpu_llm.eval.backend import TpuLM

    run = save_run(gpt2["dirs"]["run_dir"], tmp_path / "lora-run", *lora_model(gpt2["dirs"]["run_dir"]))
    merged = tmp_path / "merged"
    assert cli.main(["export", "--run_dir", str(run), "--format", "run", "--output", str(merged)]) == 0

    from lm_eval.tasks import TaskManager

    manager = TaskManager(include_path=TASKS_DIR, include_defaults=False)
    scores = {}
    for name, where in (("lora", run), ("merged", merged)):
        results = lm_eval.simple_evaluate(model=TpuLM.from_run(str(where), batch_size=8), tasks=TASKS[:2],
                                          task_manager=manager, log_samples=True, limit=3)
        scores[name] = [r for task in TASKS[:2] for s in results["samples"][task] for (r,) in s["resps"]]
    base_scores = [r for task in TASKS[:2] for s in gpt2["ours_results"]["samples"][task][:3] for (r,) in s["resps"]]
    value = lambda r: r[0] if isinstance(r, (tuple, list)) else r  # noqa: E731  (loglikelihood, is_greedy) or a sum
    assert len(scores["lora"]) == len(scores["merged"]) == len(base_scores) > 0
    for a, b in zip(scores["lora"], scores["merged"]):
        assert close(value(a), value(b), relative=True), (a, b)
    assert max(abs(value(a) - value(b)) for a, b in zip(scores["lora"], base_scores)) > 0.01  # the adapters count


@pytest.mark.parametrize("base_dtype", ["bfloat16", "int8"])
def test_a_lora_run_on_a_stored_base_scores_with_that_base(gpt2, tmp_path, base_dtype):
    """A LoRA run whose frozen base is stored in bfloat16 or int8 (train.lora_base_dtype) is evaluated with that
    base, as it trained: every request's loglikelihood equals the saved model's own (its logits, computed here
    directly) within 1e-4, and differs from the float32 base's with the same adapters (so the stored base, not
    a float32 copy, was loaded)."""
    import tensorflow as tf

    from tpu_llm.eval.backend import TpuLM

    imported = gpt2["dirs"]["run_dir"]
    models = {dtype: lora_model(imported, dtype) for dtype in ("float32", base_dtype)}  # the same adapters
    lm = TpuLM.from_run(str(save_run(imported, tmp_path / "run", *models[base_dtype])), batch_size=4)
    stored = [v for v in lm.model.weights if "lora" not in v.path and v.dtype != "float32"]
    assert stored, "the loaded model holds no base weight in " + base_dtype
    texts = [("def add(a, b):", " return a + b"), ("The quick brown", " fox"), ("x", " = 1")]
    requests = [((c, r), lm.tok_encode(c), lm.tok_encode(r)) for c, r in texts]
    scores = [score for score, _ in lm._loglikelihood_tokens(requests, disable_tqdm=True)]

    def direct(model) -> list[float]:
        out = []
        for _, context, continuation in requests:
            whole = context + continuation
            logits = tf.cast(model(tf.constant([whole[:-1]]), training=False), tf.float32)[0, :, :lm.vocab]
            logprobs = tf.nn.log_softmax(logits).numpy()
            n = len(continuation)
            out.append(float(sum(logprobs[len(whole) - 1 - n + j, t] for j, t in enumerate(continuation))))
        return out

    for ours, saved in zip(scores, direct(models[base_dtype][1])):
        assert close(ours, saved), (ours, saved)
    assert max(abs(a - b) for a, b in zip(scores, direct(models["float32"][1]))) > 1e-4  # the stored base counts


@pytest.mark.parametrize("flags, message", [
    (["--limit", "0"], "error: --limit=0: give a number of documents per task >= 1"),
    (["--limit", "x"], "error: --limit='x' must be an integer"),
    (["--tasks", " , "], "error: --tasks: give one or more lm-eval task names"),
    (["--include_path", "no/such/dir"], "error: --include_path 'no/such/dir' is not a directory"),
    (["--batch_size", "0"], "error: --batch_size=0: give 1 or more rows"),
    (["--cpu_devices", "0"], "error: --cpu_devices=0: give 1 or more logical CPU devices"),
])
def test_cli_refuses_in_one_line(flags, message, tmp_path, capsys):
    args = {"--run_dir": str(tmp_path / "run"), "--tasks": "tiny_choice", "--include_path": TASKS_DIR}
    args.update(dict(zip(flags[::2], flags[1::2])))
    assert cli.main(["eval", *[x for kv in args.items() for x in kv]]) == 2
    err = capsys.readouterr().err
    assert err.startswith(message) and err.count("\n") == 1, err


def test_a_cluster_in_tf_config_is_refused_not_joined(tmp_path, monkeypatch, capsys):
    # the evaluation runs in this process: TF_CONFIG naming workers is one line, before anything is loaded
    cluster = {"cluster": {"worker": ["127.0.0.1:1", "127.0.0.1:2"]}, "task": {"type": "worker", "index": 0}}
    monkeypatch.setenv("TF_CONFIG", json.dumps(cluster))
    assert cli.main(["eval", "--run_dir", str(tmp_path / "run"), "--tasks", "tiny_choice", "--include_path",
                     TASKS_DIR]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: tpu-llm eval scores in this process over this machine's devices, but TF_CONFIG "
                          "names a cluster (multi_worker): unset TF_CONFIG") and err.count("\n") == 1, err


def test_text_the_vocabulary_cannot_hold_is_said_once_for_tasks_and_refused_for_a_text_file():
    """A char vocabulary (built from other data) lacks a task's characters: scoring goes on with one note (one
    emoji in one document should not stop an evaluation); --text's file is the user's own, so it is refused."""
    from types import SimpleNamespace

    from tpu_llm.eval import text as text_eval
    from tpu_llm.eval.backend import TpuLM
    from tpu_llm.tokenizers.core import CharTokenizer

    notes = []
    lm = TpuLM(None, CharTokenizer("abc d"), SimpleNamespace(model=SimpleNamespace(max_len=64)), say=notes.append)
    assert lm.tok_encode("a bad cab") == [1, 0, 2, 1, 4, 0, 3, 1, 2] and notes == []  # (ids: ' ' 0, a 1, ...)
    lm.tok_encode("abé")
    lm.tok_encode("ü and é")
    assert len(notes) == 1 and notes[0].startswith("note: the tasks' text holds characters the run's char vocabulary "
                                                   "does not hold ('é'): they are scored as the tokenizer"), notes
    with pytest.raises(UserError, match=r"^--text 'notes.txt' has 2 character\(s\) that the run's char vocabulary "
                                        r"does not hold: 'é', 'ü'; remove or replace them"):
        text_eval.perplexity(lm, "abé dü", "notes.txt")


def test_outside_a_checkout_git_stays_off_the_terminal_and_the_loop_skips_the_environment(gpt2, monkeypatch, capfd):
    """lm-eval's simple_evaluate runs `git describe` (its "fatal: not a git repository" went to the terminal)
    and torch's collect_env (~5 s, at every evaluation of the training loop, which keeps only the metrics)."""
    from lm_eval import evaluator
    from lm_eval.tasks import TaskManager

    from tpu_llm.eval.run import evaluate

    monkeypatch.setenv("GIT_DIR", "/nonexistent")  # git fails as it does outside a checkout
    manager = TaskManager(include_path=TASKS_DIR, include_defaults=False)
    before = evaluator.get_git_commit_hash, evaluator.add_env_info
    whole = evaluate(gpt2["ours"], ["tiny_choice"], manager, limit=1)
    loop = evaluate(gpt2["ours"], ["tiny_choice"], manager, limit=1, bootstrap_iters=0, environment=False)
    assert "fatal" not in capfd.readouterr().err
    assert "git_hash" in whole and "pretty_env_info" in whole and "pretty_env_info" not in loop
    assert loop["results"]["tiny_choice"]["acc,none"] == whole["results"]["tiny_choice"]["acc,none"]
    assert (evaluator.get_git_commit_hash, evaluator.add_env_info) == before  # put back


def test_an_unknown_task_names_the_close_matches():
    from tpu_llm.eval.run import check_tasks, task_manager

    manager = task_manager(TASKS_DIR, ["tiny_choice"])  # only the local tasks: lm-eval's own index takes ~15 s
    assert manager.all_tasks == sorted(TASKS)
    check_tasks(["tiny_choice", "tiny_*"], manager)  # names and lm-eval's glob patterns
    with pytest.raises(UserError, match=r"^--tasks: lm-eval has no task 'tiny_choise'; did you mean tiny_choice, tiny_gen\? "
                                        r"list them with `lm-eval ls tasks`, or give your own task YAML's folder"):
        check_tasks(["tiny_choice", "tiny_choise"], manager)


def test_a_run_without_checkpoint_is_the_loaders_error(gpt2, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(gpt2["dirs"]["run_dir"], run)
    shutil.rmtree(run / "checkpoints")
    assert cli.main(["eval", "--run_dir", str(run), "--tasks", "tiny_choice", "--include_path", TASKS_DIR]) == 2
    err = capsys.readouterr().err
    assert "has no checkpoint in checkpoints/ yet" in err and err.count("\n") == 1, err


def test_a_dataset_that_cannot_be_loaded_is_one_line_naming_it(gpt2, tmp_path, capsys):
    text = (REPO / TASKS_DIR / "tiny_choice.yaml").read_text()
    (tmp_path / "gone.yaml").write_text(text.replace("task: tiny_choice", "task: gone_choice")
                                        .replace("tiny_choice.jsonl", "gone.jsonl"))
    assert cli.main(["eval", "--run_dir", gpt2["dirs"]["run_dir"], "--tasks", "gone_choice",
                     "--include_path", str(tmp_path)]) == 2
    err = capsys.readouterr().err.splitlines()[-1]
    assert err.startswith("error: a task's dataset could not be loaded (") and "gone.jsonl" in err, err
    assert "HF_DATASETS_OFFLINE=1, or point --include_path to task YAML over local files" in err, err


def test_without_lm_eval_the_error_names_the_extra(monkeypatch, capsys):
    import sys

    monkeypatch.setitem(sys.modules, "lm_eval", None)  # `import lm_eval` raises ImportError
    with pytest.raises(UserError, match=r"pip install 'tpu-llm\[eval\]'"):
        require_lm_eval()
    assert cli.main(["eval", "--run_dir", "r", "--tasks", "tiny_choice"]) == 2
    assert capsys.readouterr().err == ("error: evaluation needs lm-evaluation-harness (lm_eval), which is not "
                                       "installed: pip install 'tpu-llm[eval]'\n")


def one_document_task(folder: Path, text: str) -> str:
    """tiny_ppl's YAML as task `one_ppl` over a JSON-lines file holding `text` as its only document."""
    (folder / "one.jsonl").write_text(json.dumps({"text": text}) + "\n", encoding="utf-8")
    yaml = (REPO / TASKS_DIR / "tiny_ppl.yaml").read_text()
    (folder / "one_ppl.yaml").write_text(yaml.replace("task: tiny_ppl", "task: one_ppl")
                                         .replace("tests/data/eval_tasks/tiny_text.jsonl", str(folder / "one.jsonl")))
    return "one_ppl"


def test_text_perplexity_equals_lm_evals_one_document_task(gpt2, tmp_path, capsys):
    """`--text FILE` gives the metrics lm-eval's loglikelihood_rolling task gives for a task whose one document
    is the file's text: the same windows (a text longer than max_len), words (lm-eval's re.split counts one
    more at each end that is whitespace) and bytes (non-ASCII letters)."""
    from lm_eval.tasks import TaskManager

    first = json.loads((REPO / TASKS_DIR / "tiny_text.jsonl").read_text(encoding="utf-8").splitlines()[0])["text"]
    text = "  " + first + "\n"
    assert len(gpt2["ours"].tok_encode(text)) > 64 and len(text.encode()) > len(text)
    task = one_document_task(tmp_path, text)
    manager = TaskManager(include_path=str(tmp_path), include_defaults=False)
    want = lm_eval.simple_evaluate(model=gpt2["ours"], tasks=[task], task_manager=manager)["results"][task]
    path, out = tmp_path / "doc.txt", tmp_path / "doc.json"
    path.write_bytes(text.encode("utf-8"))
    assert cli.main(["eval", "--run_dir", gpt2["dirs"]["run_dir"], "--text", str(path), "--output", str(out)]) == 0
    printed = capsys.readouterr().out
    saved = json.loads(out.read_text())
    assert saved["words"] == len(text.split()) + 2 and saved["bytes"] == len(text.encode("utf-8"))
    assert saved["tokens"] == len(gpt2["ours"].tok_encode(text))
    for metric in ("word_perplexity", "byte_perplexity", "bits_per_byte"):
        assert close(saved[metric], want[f"{metric},none"], relative=True), (metric, saved, want)
        assert metric in printed and f"{saved[metric]:.4f}" in printed
    assert f"|{path}" in printed and f"wrote     {out}" in printed
    # the Python API, on each of tiny_ppl's documents: the loglikelihoods lm-eval's own run logged
    import tpu_llm

    loaded = tpu_llm.load(gpt2["dirs"]["run_dir"])
    for k, sample in enumerate(gpt2["ours_results"]["samples"]["tiny_ppl"][:2]):
        (path := tmp_path / f"{k}.txt").write_text(sample["doc"]["text"], encoding="utf-8")
        got = loaded.perplexity(str(path))
        assert close(got["loglikelihood"], sample["resps"][0][0], relative=True)
        assert [got["words"], got["bytes"]] == [sample["word_perplexity"][1], sample["byte_perplexity"][1]]


@pytest.mark.parametrize("flags, content, message", [
    (["--text", "{file}"], b" \n\n", "error: --text '{file}' is empty (no text but whitespace); give a plain UTF-8"),
    (["--text", "{file}"], b"caf\xe9", "error: --text '{file}' is not UTF-8 (byte 3 is 0xe9); convert it, e.g. iconv"),
    (["--text", "{dir}/missing.txt"], None, "error: --text '{dir}/missing.txt' cannot be read (No such file"),
    (["--text", "{dir}/fifo"], "fifo", "error: --text {dir}/fifo is a named pipe (FIFO)"),  # never read: no hang
    (["--text", "{file}", "--tasks", "tiny_ppl"], b"x", "error: tpu-llm eval: --tasks and --text both given"),
    ([], None, "error: tpu-llm eval: give --tasks NAMES (lm-eval tasks) or --text FILE"),
    (["--text", "{file}", "--limit", "2"], b"x", "error: --limit applies to --tasks, not to --text"),
    (["--tasks", "tiny_choice", "--log_samples"], None, "error: --log_samples writes its files next to the results: "
                                                        "give --output FILE.json too"),
])
def test_text_and_log_samples_refuse_in_one_line(flags, content, message, tmp_path, capsys):
    file = tmp_path / "text.txt"
    if content == "fifo":
        os.mkfifo(tmp_path / "fifo")
    elif content is not None:
        file.write_bytes(content)
    fill = {"file": str(file), "dir": str(tmp_path)}
    assert cli.main(["eval", "--run_dir", str(tmp_path / "run"), *[f.format(**fill) for f in flags]]) == 2
    err = capsys.readouterr().err
    assert err.startswith(message.format(**fill)) and err.count("\n") == 1, err


def test_log_samples_writes_one_record_per_document_as_lm_eval_does(gpt2, tmp_path, capsys):
    out = tmp_path / "choice.json"
    assert cli.main(["eval", "--run_dir", gpt2["dirs"]["run_dir"], "--tasks", "tiny_choice", "--include_path",
                     TASKS_DIR, "--output", str(out), "--log_samples"]) == 0
    samples_file = tmp_path / "choice_samples_tiny_choice.jsonl"
    assert f"wrote     {samples_file}" in capsys.readouterr().out
    saved = json.loads(out.read_text())
    records = [json.loads(line) for line in samples_file.read_text(encoding="utf-8").splitlines()]
    assert len(records) == saved["n-samples"]["tiny_choice"]["original"] == 8 and "samples" not in saved
    reference = gpt2["reference_results"]["samples"]["tiny_choice"]
    right = 0
    for record, theirs in zip(records, reference):
        assert record["doc_id"] == theirs["doc_id"] and set(record["arguments"]) == {
            f"gen_args_{i}" for i in range(len(theirs["arguments"]))}  # lm-eval's EvaluationTracker layout
        lls = [float(ll) for ll, _ in record["filtered_resps"]]
        assert all(close(a, b[0][0]) for a, b in zip(lls, theirs["resps"]))
        right += lls.index(max(lls)) == int(record["target"])
        assert record["acc"] == (lls.index(max(lls)) == int(record["target"]))
    assert saved["results"]["tiny_choice"]["acc,none"] == pytest.approx(right / len(records))
