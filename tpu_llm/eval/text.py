"""`tpu-llm eval --text FILE`: the perplexity of a plain UTF-8 text file, as lm-eval's wikitext-style tasks
report it (word_perplexity, byte_perplexity, bits_per_byte).

The whole file is one document, as one wikitext page is one of that task's documents: cutting it into lines
or paragraphs would restart the context at each one and give another number than the same text as a task.
Its log-probability is the backend's `loglikelihood_rolling` (lm-eval's disjoint windows of max_len tokens);
its words and bytes are counted, and the metrics computed, by lm-eval's own functions, so the numbers are a
one-document loglikelihood_rolling task's on the same text.
"""

from __future__ import annotations

import json
import os

from tpu_llm.errors import UserError
from tpu_llm.platform import files

FIX = "give a plain UTF-8 text file"
MAX_TEXT_BYTES = 256 << 20  # scored whole, in memory: far more text than a perplexity needs


def read_text(path: str) -> str:
    """The file's text; UserError naming the file for one that cannot be read, is empty or is not UTF-8. A
    regular file only, as every file from outside (files.read_regular: a FIFO or a device is refused, not read)."""
    try:
        data = files.read_regular(path, MAX_TEXT_BYTES, "--text", "score a part of it", follow_links=True)
    except OSError as e:  # (FileNotFoundError; the reader's other troubles are its own one-line UserErrors)
        raise UserError(f"--text {path!r} cannot be read ({e.strerror or e}); {FIX}") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise UserError(f"--text {path!r} is not UTF-8 (byte {e.start} is {data[e.start]:#04x}); convert it, e.g. "
                        f"iconv -f LATIN1 -t UTF-8 {path} > {os.path.splitext(path)[0]}.utf8.txt") from None
    if not text.strip():  # nothing to score: lm-eval would count the whitespace as words
        raise UserError(f"--text {path!r} is empty (no text but whitespace); {FIX}")
    return text


def perplexity(model, text: str, path: str = "the text") -> dict:
    """{tokens, words, bytes, loglikelihood, word_perplexity, byte_perplexity, bits_per_byte} of `text` (the
    file `path`) as one document scored by `model` (TpuLM). Characters the run's vocabulary cannot hold are a
    UserError, as in a prompt: they would be scored as the unknown id, a perplexity of text nobody wrote."""
    from tpu_llm.tokenizers.core import check_covers

    check_covers(model.tok, text, f"--text {path!r}")
    from lm_eval.api.instance import Instance
    from lm_eval.api.metrics import bits_per_byte, weighted_perplexity
    from lm_eval.api.task import ConfigurableTask

    request = Instance(request_type="loglikelihood_rolling", doc={"text": text}, arguments=(text,), idx=0)
    loglikelihood = float(model.loglikelihood_rolling([request], disable_tqdm=True)[0])
    words, size = ConfigurableTask.count_words(text), ConfigurableTask.count_bytes(text)
    return {"tokens": len(model.tok_encode(text)), "words": words, "bytes": size, "loglikelihood": loglikelihood,
            "word_perplexity": weighted_perplexity([(loglikelihood, words)]),
            "byte_perplexity": weighted_perplexity([(loglikelihood, size)]),
            "bits_per_byte": bits_per_byte([(loglikelihood, size)])}


def table(path: str, result: dict) -> str:
    """A small Markdown table in the style of lm-eval's."""
    head = ["File", "Tokens", "Words", "Bytes", "word_perplexity", "byte_perplexity", "bits_per_byte"]
    row = [path, str(result["tokens"]), str(result["words"]), str(result["bytes"]),
           *(f"{result[k]:.4f}" for k in head[4:])]
    widths = [max(len(h), len(v)) for h, v in zip(head, row)]
    line = lambda cells, align: "|" + "|".join(align(c, w) for c, w in zip(cells, widths)) + "|"  # noqa: E731
    return "\n".join([line(head, str.ljust), "|" + "|".join("-" * w for w in widths) + "|",
                      line(row, lambda c, w: c.ljust(w) if c == path else c.rjust(w))])


def result_json(path: str, result: dict) -> str:
    return json.dumps({"text": path, **result}, indent=2, ensure_ascii=False)
