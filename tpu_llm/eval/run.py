"""`tpu-llm eval`: lm-evaluation-harness tasks on a run's newest checkpoint, through `TpuLM`.

The arguments are checked before anything loads (`check_arguments`), the task names against lm-eval's own
index (its TaskManager, which also reads --include_path's YAML) before the model loads, and the run's
checkpoint by the loader `tpu-llm generate` uses. lm-eval computes every metric; this module only prints its
table (lm_eval.utils.make_table) and writes its results dictionary as JSON, and with --log_samples its
per-sample records as `lm_eval --log_samples` writes them. `--text FILE` is tpu_llm/eval/text.py.
"""

from __future__ import annotations

import contextlib
import difflib
import json
import os
import subprocess
from typing import Callable

from tpu_llm.errors import UserError
from tpu_llm.eval import require_lm_eval


def whole_number(flag: str, text: str) -> int | None:
    """--flag's integer, None when not given."""
    if text == "":
        return None
    try:
        return int(text)
    except ValueError:
        raise UserError(f"--{flag}={text!r} must be an integer") from None


def task_list(tasks: str) -> list[str]:
    names = [t.strip() for t in tasks.split(",") if t.strip()]
    if not names:
        raise UserError("--tasks: give one or more lm-eval task names, comma-separated (e.g. --tasks hellaswag,arc_easy)")
    return names


def check_choice(tasks: str, text: str, include_path: str = "", num_fewshot: int | None = None,
                 limit: int | None = None, log_samples: bool = False) -> None:
    """UserError unless exactly one of --tasks and --text is given, with only the flags that apply to it."""
    if bool(tasks) == bool(text):
        which = "--tasks and --text both given; give one: " if tasks else "give "
        raise UserError(f"tpu-llm eval: {which}--tasks NAMES (lm-eval tasks) or --text FILE "
                        "(a text file's perplexity)")
    if text:
        given = [flag for flag, value in (("--include_path", include_path), ("--num_fewshot", num_fewshot),
                                          ("--limit", limit), ("--log_samples", log_samples))
                 if value not in ("", None, False)]
        if given:
            raise UserError(f"{given[0]} applies to --tasks, not to --text (the whole file is one document)")


def check_arguments(tasks: str, include_path: str, num_fewshot: int, limit: int, batch_size: int,
                    output: str) -> list[str]:
    """The task names; UserError for an argument no evaluation could use (nothing is loaded yet)."""
    if limit is not None and limit <= 0:
        raise UserError(f"--limit={limit}: give a number of documents per task >= 1 (leave it out for all of them)")
    if num_fewshot is not None and num_fewshot < 0:
        raise UserError(f"--num_fewshot={num_fewshot}: give 0 or more examples")
    check_output(batch_size, output)
    if include_path and not os.path.isdir(include_path):
        raise UserError(f"--include_path {include_path!r} is not a directory (give the folder of your task YAML files)")
    return task_list(tasks)


def check_output(batch_size: int, output: str) -> None:
    if batch_size < 1:
        raise UserError(f"--batch_size={batch_size}: give 1 or more rows")
    if output and not os.path.isdir(os.path.dirname(os.path.abspath(output))):
        raise UserError(f"--output {output!r}: its directory does not exist")


def task_manager(include_path: str = "", names: list[str] = ()):
    """lm-eval's TaskManager over the YAML files under `include_path` (trusted: a task YAML can run Python
    through `!function`) and, unless every one of `names` is among those, lm-eval's own tasks (indexing its
    ~15,000 task, group and tag names takes ~15 s)."""
    require_lm_eval()
    from lm_eval.tasks import TaskManager

    if include_path:
        local = TaskManager(include_path=include_path, include_defaults=False)
        if names and all(known(name, local) for name in names):
            return local
    return TaskManager(include_path=include_path or None)


def known(name: str, manager) -> bool:
    return name in manager.all_tasks or bool(manager.match_tasks([name])) or (
        name.endswith((".yaml", ".yml")) and os.path.isfile(name))


def check_tasks(names: list[str], manager, flag: str = "--tasks", include: str = "--include_path DIR") -> None:
    """UserError naming the close matches of the first name lm-eval knows no task, group or tag by (`flag` and
    `include`: the command's flags, or the config keys of a run's train.eval_tasks)."""
    for name in names:
        if known(name, manager):
            continue
        close = difflib.get_close_matches(name, manager.all_tasks, n=3, cutoff=0.6)
        hint = f"did you mean {', '.join(close)}? " if close else ""
        raise UserError(f"{flag}: lm-eval has no task {name!r}; {hint}list them with `lm-eval ls tasks`, or give "
                        f"your own task YAML's folder with {include}")


def evaluate(model, names: list[str], manager, num_fewshot: int | None = None, limit: int | None = None,
             log_samples: bool = False, bootstrap_iters: int = 100000, environment: bool = True) -> dict:
    """lm-eval's results dictionary for `names` evaluated with `model` (an lm-eval LM, e.g. TpuLM);
    `bootstrap_iters` 0 computes no bootstrapped standard errors (lm-eval's default is 100000); without
    `environment` the results leave out lm-eval's description of the machine (see `quiet_records`)."""
    import lm_eval

    try:
        with quiet_records(environment):
            return lm_eval.simple_evaluate(model=model, tasks=names, num_fewshot=num_fewshot, limit=limit,
                                           task_manager=manager, log_samples=log_samples,
                                           bootstrap_iters=bootstrap_iters)
    except (ConnectionError, FileNotFoundError) as e:  # datasets' own errors derive from these two
        reason = " ".join(str(e).split())[:300]
        raise UserError(f"a task's dataset could not be loaded ({reason}); without network access fill the datasets "
                        "cache on a machine that has it and set HF_DATASETS_OFFLINE=1, or point --include_path to "
                        "task YAML over local files (dataset_path: json, dataset_kwargs: {data_files: ...}; "
                        "docs/evaluation.md)") from None


@contextlib.contextmanager
def quiet_records(environment: bool = True):
    """What simple_evaluate records of its surroundings, without its side effects on the terminal and clock:
    the working directory's commit without `git describe`'s stderr ("fatal: not a git repository" outside a
    checkout, a line among tpu-llm's), and, unless `environment`, none of lm_eval.loggers.utils.add_env_info
    (torch's collect_env, about 5 s with torch installed: paid at every evaluation of the training loop,
    which keeps only the metrics). lm-eval offers no switch for either; its module's two names are swapped
    for the call and put back."""
    from lm_eval import evaluator
    from lm_eval.loggers.utils import get_commit_from_path

    def commit() -> str | None:  # lm-eval's get_git_commit_hash, with git's stderr kept off the terminal
        try:
            return subprocess.run(["git", "describe", "--always"], capture_output=True, text=True,
                                  check=True).stdout.strip()
        except (subprocess.CalledProcessError, OSError):
            return get_commit_from_path(os.getcwd())

    saved = evaluator.get_git_commit_hash, evaluator.add_env_info
    evaluator.get_git_commit_hash = commit
    if not environment:
        evaluator.add_env_info = lambda storage: None
    try:
        yield
    finally:
        evaluator.get_git_commit_hash, evaluator.add_env_info = saved


def results_json(results: dict) -> str:
    """The results as lm-eval's `--output_path` writes them (per-sample records left out)."""
    from lm_eval.utils import handle_non_serializable

    kept = {k: v for k, v in results.items() if k != "samples"}
    return json.dumps(kept, indent=2, default=handle_non_serializable, ensure_ascii=False)


def sample_record(sample: dict) -> dict:
    """A per-sample record as lm-eval's EvaluationTracker.save_results_samples writes it (arguments as
    gen_args_i/arg_j, responses made JSON-safe, the target as text), so lm-eval's readers of them read ours."""
    from lm_eval.utils import sanitize_list

    arguments = {f"gen_args_{i}": {f"arg_{j}": a for j, a in enumerate(arg)}
                 for i, arg in enumerate(sample["arguments"])}
    return {**sample, "arguments": arguments, "resps": sanitize_list(sample["resps"]),
            "filtered_resps": sanitize_list(sample["filtered_resps"]), "target": str(sample["target"])}


def write_samples(output: str, samples: dict) -> list[str]:
    """`<output stem>_samples_<task>.jsonl` per task, one record a document; the paths written. lm-eval's own
    names carry the time (samples_<task>_<date>.jsonl) and append; these are overwritten, like `output`."""
    from lm_eval.utils import handle_non_serializable

    paths = []
    for task, records in samples.items():
        path = f"{os.path.splitext(output)[0]}_samples_{task}.jsonl"
        with open(path, "w", encoding="utf-8") as f:
            for sample in records:
                f.write(json.dumps(sample_record(sample), default=handle_non_serializable, ensure_ascii=False) + "\n")
        paths.append(path)
    return paths


def prepare(tasks: str | list[str], include_path: str = "", num_fewshot: int | None = None, limit: int | None = None,
            batch_size: int = 8, output: str = "") -> tuple[list[str], object]:
    """(task names, lm-eval's TaskManager) once every argument and task name is checked; nothing loaded yet."""
    text = tasks if isinstance(tasks, str) else ",".join(tasks)
    names = check_arguments(text, include_path, num_fewshot, limit, batch_size, output)
    manager = task_manager(include_path, names)
    check_tasks(names, manager)
    return names, manager


def scoring_strategy(cpu_devices: int = 1, tpu: str = "", say: Callable[[str], None] = print):
    """The tf.distribute strategy `tpu-llm eval` scores over, found as `train`'s strategy=auto finds devices (a
    TPU's cores, two or more GPUs, or `cpu_devices` logical CPUs), or None for one device. Before any other
    TensorFlow work (it may split the CPU). One process: a TF_CONFIG cluster is refused, not joined."""
    from tpu_llm.config import load_config
    from tpu_llm.parallel.distribute import choose, get_strategy, look_around

    if cpu_devices < 1:
        raise UserError(f"--cpu_devices={cpu_devices}: give 1 or more logical CPU devices")
    cfg = load_config(None, {"cpu_devices": cpu_devices, "tpu": tpu})
    found = look_around(cfg)
    name, why = choose(cfg, found)
    if name in ("multi_worker", "parameter_server"):
        raise UserError(f"tpu-llm eval scores in this process over this machine's devices, but TF_CONFIG names a "
                        f"cluster ({name}): unset TF_CONFIG for the evaluation")
    dist = get_strategy(cfg, found)
    if dist.num_replicas < 2:
        return None
    say(f"devices   {dist.num_replicas} replicas ({why}): the requests are scored in parallel over them")
    return dist.strategy


def on_weights(model, tokenizer, config, tasks: str | list[str], include_path: str = "", num_fewshot: int | None = None,
               limit: int | None = None, batch_size: int = 8, log_samples: bool = False) -> dict:
    """lm-eval's results for `tasks` on a model already loaded (`tpu_llm.load(run_dir).evaluate`)."""
    names, manager = prepare(tasks, include_path, num_fewshot, limit, batch_size)
    from tpu_llm.eval.backend import TpuLM

    return evaluate(TpuLM(model, tokenizer, config, batch_size=batch_size), names, manager, num_fewshot, limit,
                    log_samples)


def text_on_weights(model, tokenizer, config, path: str, batch_size: int = 8) -> dict:
    """The perplexity of the text file `path` on a model already loaded (`tpu_llm.load(run_dir).perplexity`)."""
    from tpu_llm.eval import text as text_eval

    check_output(batch_size, "")
    content = text_eval.read_text(path)
    require_lm_eval()
    from tpu_llm.eval.backend import TpuLM  # imports lm_eval

    return text_eval.perplexity(TpuLM(model, tokenizer, config, batch_size=batch_size), content, path)


def run(run_dir: str, tasks: str, include_path: str = "", num_fewshot: int | None = None, limit: int | None = None,
        batch_size: int = 8, output: str = "", say: Callable[[str], None] = print, log_samples: bool = False,
        cpu_devices: int = 1, tpu: str = "") -> dict:
    """`tpu-llm eval`: check, load, evaluate, print the table, write `output` (and with `log_samples` the
    per-sample records next to it); returns lm-eval's results. Data parallel over the devices
    `scoring_strategy` finds."""
    if log_samples and not output:
        raise UserError("--log_samples writes its files next to the results: give --output FILE.json too")
    names, manager = prepare(tasks, include_path, num_fewshot, limit, batch_size, output)
    from lm_eval.utils import make_table

    from tpu_llm.eval.backend import TpuLM

    strategy = scoring_strategy(cpu_devices, tpu, say)
    model = TpuLM.from_run(run_dir, batch_size=batch_size, strategy=strategy)
    results = evaluate(model, names, manager, num_fewshot, limit, log_samples)
    say(make_table(results))
    if "groups" in results:
        say(make_table(results, "groups"))
    if output:
        with open(output, "w", encoding="utf-8") as f:
            f.write(results_json(results))
        say(f"wrote     {output}")
        for path in write_samples(output, results["samples"]) if log_samples else []:
            say(f"wrote     {path}")
    return results


def run_text(run_dir: str, path: str, batch_size: int = 8, output: str = "",
             say: Callable[[str], None] = print, cpu_devices: int = 1, tpu: str = "") -> dict:
    """`tpu-llm eval --text FILE`: the file's perplexity as one document; prints a table, writes `output`."""
    from tpu_llm.eval import text as text_eval

    check_output(batch_size, output)
    content = text_eval.read_text(path)
    require_lm_eval()
    from tpu_llm.eval.backend import TpuLM

    strategy = scoring_strategy(cpu_devices, tpu, say)
    result = text_eval.perplexity(TpuLM.from_run(run_dir, batch_size=batch_size, strategy=strategy), content, path)
    say(text_eval.table(path, result))
    if output:
        with open(output, "w", encoding="utf-8") as f:
            f.write(text_eval.result_json(path, result))
        say(f"wrote     {output}")
    return result


def command(run_dir: str, tasks: str, text: str, include_path: str, num_fewshot: str, limit: str, batch_size: int,
            output: str, log_samples: bool, cpu_devices: int = 1, tpu: str = "") -> None:
    """`tpu-llm eval` with its flags as given: --tasks (`run`) or --text (`run_text`)."""
    fewshot, most = whole_number("num_fewshot", num_fewshot), whole_number("limit", limit)
    check_choice(tasks, text, include_path, fewshot, most, log_samples)
    if text:
        run_text(run_dir, text, batch_size, output, cpu_devices=cpu_devices, tpu=tpu)
    else:
        run(run_dir, tasks, include_path, fewshot, most, batch_size, output, log_samples=log_samples,
            cpu_devices=cpu_devices, tpu=tpu)
