"""A tiny character-level Hugging Face tokenizer folder for the digit tasks (`mindspeed-proxy write-tokenizer DIR`).

Megatron-LM's `--tokenizer-type HuggingFaceTokenizer --tokenizer-model DIR` loads it with
`transformers.AutoTokenizer.from_pretrained(DIR)`. Every character of the task alphabet is one token; the
special tokens are UNK, PAD and EOD (the `eos_token`, Megatron-LM's `eod`), and there is no BOS (Megatron-LM's
RL then adds none). PAD is not id 0: Megatron-LM's `prepare_trajectories` tests `if not tokenizer.pad` and
refuses a falsy pad id. Decoding concatenates the characters (no spaces).
"""
from __future__ import annotations

import argparse
import os
from pathlib import Path

PAD, EOD, UNK = "<pad>", "<eod>", "<unk>"
SPECIALS = (UNK, PAD, EOD)  # ids 0, 1, 2
ALPHABET = "0123456789+="  # what the digit tasks of mindspeed_proxy.rl.tasks write


def vocabulary(alphabet: str = ALPHABET) -> dict[str, int]:
    """Token -> id: the special tokens first, then each character of `alphabet` once, in order."""
    chars = list(dict.fromkeys(alphabet))
    if not chars or "\n" in chars:
        raise ValueError(f"alphabet {alphabet!r} must be non-empty and on one line")
    return {tok: i for i, tok in enumerate(list(SPECIALS) + chars)}


def build(alphabet: str = ALPHABET):
    """The `transformers.PreTrainedTokenizerFast` of `alphabet` (one token per character)."""
    from mindspeed_proxy.extras import require

    require("transformers", "writing a tokenizer folder")  # brings `tokenizers`
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.WordLevel(vocab=vocabulary(alphabet), unk_token=UNK))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=core, eos_token=EOD, pad_token=PAD, unk_token=UNK)


def write_tokenizer(directory: str | os.PathLike, alphabet: str = ALPHABET) -> Path:
    """Write the tokenizer of `alphabet` to `directory` (created; files of a previous write replaced)."""
    out = Path(directory)
    if out.exists() and not out.is_dir():
        raise ValueError(f"{out} exists and is not a directory")
    tokenizer = build(alphabet)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(str(out))
    return out


def main(argv=None, prog: str = "mindspeed-proxy write-tokenizer") -> int:
    """Entry point: write the tokenizer folder named on the command line."""
    from mindspeed_proxy.cli import error

    parser = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    parser.add_argument("directory", help="folder to write (tokenizer.json, tokenizer_config.json)")
    parser.add_argument("--alphabet", default=ALPHABET, help=f"characters, one token each (default {ALPHABET!r})")
    args = parser.parse_args(argv)
    try:
        out = write_tokenizer(args.directory, args.alphabet)
    except (ValueError, OSError) as exc:
        return error(prog, exc)
    print(f"wrote a {len(vocabulary(args.alphabet))}-token tokenizer to {out}")
    return 0
