"""A tiny Llama-shaped model made on the spot: no weights can be fetched from a hub here.

`python -m engines.tiny_model DIR` (run with the vLLM venv's python, which has torch,
transformers and tokenizers) writes into DIR a byte-level BPE tokenizer trained on generated
text, a chat template, a `LlamaForCausalLM` config and random weights. The same seed gives the
same files. The model says nothing sensible; it computes as much per token as a real model of
its shape, which is what an engine's timing and caching depend on.

`ensure_model(venv_python, folder)` makes it through that interpreter unless it is there.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

SPECIAL_TOKENS = ("<|bos|>", "<|eos|>", "<|pad|>", "<|end|>")
ROLES = ("system", "user", "assistant", "tool", "developer")
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "<|end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
MARKER = "tiny-model.json"
# fmt: off
ONSETS = ["", "b", "c", "d", "f", "g", "h", "k", "l", "m", "n", "p", "r", "s", "t", "v", "w",
          "z", "ch", "sh", "th", "st", "tr", "pl", "gr"]
VOWELS = ["a", "e", "i", "o", "u", "ai", "ea", "ou", "io"]
CODAS = ["", "", "n", "r", "s", "t", "l", "m", "nd", "ng", "st"]
COMMON_WORDS = ["the", "a", "of", "and", "to", "in", "is", "you", "that", "it", "for", "on",
                "with", "as", "are", "this", "be", "at", "or", "from", "what", "how", "why"]
# fmt: on


@dataclass(frozen=True)
class Shape:
    """What the model is made of; written to DIR/tiny-model.json so a folder says its shape."""

    seed: int = 0
    vocab_size: int = 4096
    hidden_size: int = 512
    intermediate_size: int = 1536
    layers: int = 4
    heads: int = 8
    kv_heads: int = 2
    max_positions: int = 4096
    corpus_words: int = 200_000


def corpus(seed: int, words: int) -> list[str]:
    """Lines of made-up words built from syllables, with digits and punctuation mixed in."""
    rng = random.Random(seed)
    onsets, vowels, codas = ONSETS, VOWELS, CODAS
    lexicon = [
        "".join(
            rng.choice(onsets) + rng.choice(vowels) + rng.choice(codas)
            for _ in range(rng.randint(1, 3))
        )
        for _ in range(3000)
    ]
    lexicon += COMMON_WORDS
    lines: list[str] = []
    line: list[str] = []
    for _ in range(words):
        word = rng.choice(lexicon)
        if rng.random() < 0.08:
            word = word.capitalize()
        if rng.random() < 0.03:
            word = str(rng.randint(0, 9999))
        line.append(word + rng.choice(["", "", "", "", "", ",", ".", "?", ":"]))
        if rng.random() < 0.06:
            lines.append(" ".join(line))
            line = []
    lines.append(" ".join(line))
    return lines


def make_tokenizer(folder: Path, shape: Shape) -> dict[str, int]:
    """Write the tokenizer and its config (with the chat template) into `folder`; needs only
    `tokenizers`. Returns the special tokens' ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    folder.mkdir(parents=True, exist_ok=True)
    specials = [*SPECIAL_TOKENS, *(f"<|{role}|>" for role in ROLES)]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=shape.vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus(shape.seed, shape.corpus_words), trainer=trainer)
    tokenizer.save(str(folder / "tokenizer.json"))
    ids = {"vocab_size": tokenizer.get_vocab_size()}
    for token in specials:
        found = tokenizer.token_to_id(token)
        if found is None:
            raise RuntimeError(f"the trained tokenizer lacks {token}")
        ids[token] = found

    tokenizer_config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|bos|>",
        "eos_token": "<|eos|>",
        "pad_token": "<|pad|>",
        "model_max_length": shape.max_positions,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")
    (folder / "special_tokens_map.json").write_text(
        json.dumps(
            {"bos_token": "<|bos|>", "eos_token": "<|eos|>", "pad_token": "<|pad|>"}, indent=2
        )
        + "\n"
    )
    return ids


def make(folder: Path, shape: Shape) -> None:
    """Write tokenizer, chat template, config and weights into `folder` (made if missing)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    ids = make_tokenizer(folder, shape)
    vocab_size = ids["vocab_size"]

    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        max_position_embeddings=shape.max_positions,
        bos_token_id=ids["<|bos|>"],
        eos_token_id=[ids["<|eos|>"], ids["<|end|>"]],
        pad_token_id=ids["<|pad|>"],
        tie_word_embeddings=False,
        torch_dtype="bfloat16",
    )
    torch.manual_seed(shape.seed)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(str(folder), safe_serialization=True)
    generation = {"bos_token_id": ids["<|bos|>"], "eos_token_id": [ids["<|eos|>"], ids["<|end|>"]]}
    (folder / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    (folder / MARKER).write_text(json.dumps(asdict(shape), indent=2) + "\n")


def is_made(folder: Path, shape: Shape) -> bool:
    marker = folder / MARKER
    if not marker.is_file():
        return False
    try:
        return bool(json.loads(marker.read_text()) == asdict(shape))
    except ValueError:
        return False


def ensure_model(python: Path, folder: Path, shape: Shape | None = None) -> Path:
    """Make the model in `folder` with `python` (the vLLM venv's) unless it is already there."""
    wanted = shape or Shape()
    if not is_made(folder, wanted):
        command = [str(python), "-m", __name__, str(folder), "--seed", str(wanted.seed)]
        defaults = Shape()
        for option, value, default in (
            ("--hidden", wanted.hidden_size, defaults.hidden_size),
            ("--intermediate", wanted.intermediate_size, defaults.intermediate_size),
            ("--layers", wanted.layers, defaults.layers),
            ("--heads", wanted.heads, defaults.heads),
            ("--kv-heads", wanted.kv_heads, defaults.kv_heads),
            ("--vocab", wanted.vocab_size, defaults.vocab_size),
        ):
            if value != default:
                command += [option, str(value)]
        root = Path(__file__).resolve().parent.parent
        subprocess.run(command, check=True, cwd=root, stdin=subprocess.DEVNULL)
    return folder


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("folder", type=Path)
    defaults = Shape()
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--hidden", type=int, default=defaults.hidden_size)
    parser.add_argument("--intermediate", type=int, default=defaults.intermediate_size)
    parser.add_argument("--layers", type=int, default=defaults.layers)
    parser.add_argument("--heads", type=int, default=defaults.heads)
    parser.add_argument("--kv-heads", type=int, default=defaults.kv_heads)
    parser.add_argument("--vocab", type=int, default=defaults.vocab_size)
    options = parser.parse_args(argv)
    shape = Shape(
        seed=options.seed,
        vocab_size=options.vocab,
        hidden_size=options.hidden,
        intermediate_size=options.intermediate,
        layers=options.layers,
        heads=options.heads,
        kv_heads=options.kv_heads,
    )
    make(options.folder, shape)
    print(options.folder, file=sys.stderr)


if __name__ == "__main__":
    main()
