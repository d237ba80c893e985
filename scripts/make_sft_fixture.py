"""Make a tiny SFT fixture for stock Megatron-LM ``--sft``: a character-level chat tokenizer and a JSONL file.

    python scripts/make_sft_fixture.py OUT_DIR [--lines 200] [--seed 1234] [--pad-to 8]

writes ``OUT_DIR/tokenizer/`` (a ``transformers.PreTrainedTokenizerFast`` saved with ``save_pretrained``: one token
per character, plus the special tokens of Megatron-LM's ``nemotron-h-aligned`` SFT prompt format, ``<SPECIAL_10>``,
``<SPECIAL_11>``, pad ``<SPECIAL_233>``, and ``</s>`` as end of document) and ``OUT_DIR/sft.jsonl`` (``--lines``
lines, each a ``{"messages": [...]}`` list of 1 to 4 packed conversations, system / user / assistant). The text
is learnable (the assistant continues the user's count, step given by the system line), and the conversations
have varied token counts (odd and even; with the defaults 500 conversations of 41 to 68 tokens of text, 125
odd). ``--pad-to N`` (default 8) ends each assistant reply with loss-masked pad tokens (``<SPECIAL_233>``, before
the template's closing newline) so that every conversation is a multiple of N tokens long: then ``SFTDataset``'s
own padding to a multiple of 2 x CP adds nothing at CP = 1, 2 or 4 (N = 8) and the packed stream is the same at
every CP. ``--pad-to 1`` leaves the text unpadded (``SFTDataset`` then pads at CP > 1 itself, so the packed layout,
and with it the positions the ring's attention dropout is keyed on, differ between CP sizes).

Built locally from the generated text: nothing is downloaded. Needs ``tokenizers`` and ``transformers`` only
when run (the pins are in docs/megatron-runs.md); nothing in the package or the tests imports this file.
"""

import argparse
import json
import os
import random

SPECIALS = ["<SPECIAL_10>", "<SPECIAL_11>", "<SPECIAL_233>", "</s>", "<unk>"]
ALPHABET = sorted(set("0123456789 SystemUserAssistantcountbyfromstep\n"))


def conversation(rng):
    step = rng.randint(1, 3)
    start = rng.randint(0, 9)
    asked = rng.randint(1, 4)
    answered = rng.randint(2, 12)
    sep = rng.choice([" ", ""])
    seq = [(start + step * i) % 10 for i in range(asked + answered)]
    return [
        {"role": "system", "content": f"count by {step}"},
        {"role": "user", "content": sep.join(map(str, seq[:asked]))},
        {"role": "assistant", "content": sep.join(map(str, seq[asked:]))},
    ]


def template_text(conv):
    """The text of Megatron-LM's nemotron-h-aligned template for one conversation (one token per character)."""
    out = []
    for m in conv:
        if m["role"] == "system":
            out.append("<SPECIAL_10>System\n" + m["content"].strip() + "\n")
        elif m["role"] == "user":
            out.append("<SPECIAL_11>User\n" + m["content"].strip() + "\n<SPECIAL_11>Assistant\n")
        else:
            out.append(m["content"].strip() + "\n")
    return "".join(out)


def make_lines(count, seed, pad_to, tok):
    rng = random.Random(seed)
    lines, lengths = [], []
    for _ in range(count):
        messages = []
        for _ in range(rng.randint(1, 4)):
            conv = conversation(rng)
            n = len(tok(template_text(conv), add_special_tokens=False)["input_ids"])
            lengths.append(n)
            conv[-1]["content"] += "<SPECIAL_233>" * (-n % pad_to)
            messages.extend(conv)
        lines.append({"messages": messages})
    return lines, lengths


def make_tokenizer(path):
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIALS + ALPHABET)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    # one token per character; the special tokens are matched first as added tokens
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", eos_token="</s>", pad_token="<SPECIAL_233>",
        additional_special_tokens=["<SPECIAL_10>", "<SPECIAL_11>"])
    fast.save_pretrained(path)
    return fast


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir")
    parser.add_argument("--lines", type=int, default=200)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--pad-to", type=int, default=8)
    args = parser.parse_args()
    os.makedirs(args.out_dir, exist_ok=True)
    tok = make_tokenizer(os.path.join(args.out_dir, "tokenizer"))
    lines, lengths = make_lines(args.lines, args.seed, args.pad_to, tok)
    with open(os.path.join(args.out_dir, "sft.jsonl"), "w") as f:
        for line in lines:
            f.write(json.dumps(line) + "\n")
    odd = sum(n % 2 for n in lengths)
    print(f"vocab {len(tok)}; {len(lines)} lines, {len(lengths)} conversations of {min(lengths)} to "
          f"{max(lengths)} tokens of text ({odd} odd), padded to a multiple of {args.pad_to} -> {args.out_dir}")


if __name__ == "__main__":
    main()
