"""Tokenizers: a checkpoint's own, or the built-in byte-level BPE of the tiny presets.

The built-in tokenizer is trained at start-up on a short embedded corpus, so a
preset needs no files. Its vocabulary is the 256 byte symbols, a few hundred
merges and the chat special tokens; characters outside the corpus (CJK, emoji)
split into byte tokens, which exercises incremental UTF-8 detokenization.
"""

from __future__ import annotations

import functools
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TINY_VOCAB_SIZE = 512
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
_CORPUS = """\
The quick brown fox jumps over the lazy dog. A language model predicts the next token.
Prefill computes the prompt; decode generates one token at a time from the KV cache.
Hello world! The capital of France is Paris. One, two, three, four, five, six, seven.
In the beginning there was a paged attention kernel, and the blocks were sixteen tokens.
def main():\n    print("hello")\n    return 0\n
Serving large language models on a cluster: prefill workers, decode workers, routers.
"""


@functools.lru_cache(maxsize=1)
def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """The deterministic byte-level BPE tokenizer of the random-init presets."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=TINY_VOCAB_SIZE - len(SPECIAL_TOKENS),
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS.splitlines(), trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        chat_template=CHAT_TEMPLATE,
    )


def save_tiny_tokenizer(directory: str | Path) -> None:
    """Write tokenizer.json + tokenizer_config.json as a checkpoint carries them."""
    tiny_tokenizer().save_pretrained(str(directory))


def load_tokenizer(directory: str | Path) -> PreTrainedTokenizerBase:
    path = Path(directory)
    if not (path / "tokenizer.json").is_file():
        raise FileNotFoundError(
            f"no tokenizer.json in {path}: a model directory needs tokenizer.json and "
            "tokenizer_config.json next to config.json"
        )
    return AutoTokenizer.from_pretrained(str(path))
