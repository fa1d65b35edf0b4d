"""Write a tiny randomly-initialised Llama model directory for vLLM (no downloads).

Run with the vLLM venv's python (it has ``tokenizers``)::

    .venv-vllm/bin/python tests/e2e_vllm/make_tiny_model.py OUT_DIR

Writes ``config.json`` (2-layer LlamaForCausalLM, hidden 128, 4 heads of 32), and a
byte-level BPE tokenizer trained here on generated text: ``tokenizer.json`` +
``tokenizer_config.json`` (with a ``chat_template``). Serve it with
``--load-format dummy --dtype float32``: vLLM fills the weights with random values.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

VOCAB_SIZE = 2048
SPECIALS = ["<s>", "</s>", "<unk>", "<pad>"]  # ids 0..3
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}{{ eos_token }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

WORDS = (
    "the a an of to and in is it that for on with as was by at be this from or have not "
    "are but had they you which one all were we when there can been has more if will no "
    "would what so about out up into them some time these could other than then its two "
    "may first like now over such our man me even most made after also did many before "
    "must through back years where much your way well down should because each just those "
    "people how too little state good very make world still own see men work long here get "
    "both between life being under never day same another know while last might us great "
    "old year off come since against go came right used take three gateway fair queue user "
    "token request priority model server metrics latency stream batch vllm llama hello hi"
).split()


def corpus(lines: int = 6000, seed: int = 0) -> list[str]:
    """English-ish lines plus made-up syllable words, enough to fill the BPE vocabulary."""
    rng = random.Random(seed)
    syllables = [c + v for c in "bcdfghjklmnprstvwz" for v in "aeiou"]
    invented = [
        "".join(rng.choice(syllables) for _ in range(rng.randint(1, 4))) for _ in range(3000)
    ]
    words = WORDS + invented
    punct = [".", ",", "?", "!", ":", ";", "'", '"', "(", ")", "-", "0", "1", "42", "2024"]
    out = []
    for _ in range(lines):
        n = rng.randint(4, 24)
        out.append(
            " ".join(
                rng.choice(words) if rng.random() > 0.1 else rng.choice(punct) for _ in range(n)
            )
        )
    return out


def make_tokenizer(out: Path) -> int:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(), trainer=trainer)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "<s>",
                "eos_token": "</s>",
                "unk_token": "<unk>",
                "pad_token": "<pad>",
                "add_bos_token": False,
                "add_eos_token": False,
                "model_max_length": 2048,
                "clean_up_tokenization_spaces": False,
                "chat_template": CHAT_TEMPLATE,
            },
            indent=2,
        )
    )
    (out / "special_tokens_map.json").write_text(
        json.dumps(
            {
                "bos_token": "<s>",
                "eos_token": "</s>",
                "unk_token": "<unk>",
                "pad_token": "<pad>",
            },
            indent=2,
        )
    )
    return int(tok.get_vocab_size())


def make_config(out: Path, vocab_size: int) -> None:
    (out / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["LlamaForCausalLM"],
                "model_type": "llama",
                "vocab_size": vocab_size,
                "hidden_size": 128,
                "intermediate_size": 256,
                "num_hidden_layers": 2,
                "num_attention_heads": 4,
                "num_key_value_heads": 4,
                "head_dim": 32,  # the CPU attention kernel rejects 16
                "hidden_act": "silu",
                "max_position_embeddings": 2048,
                "rms_norm_eps": 1e-5,
                "rope_theta": 10000.0,
                "tie_word_embeddings": False,
                "bos_token_id": 0,
                "eos_token_id": 1,
                "pad_token_id": 3,
                "torch_dtype": "float32",
                "initializer_range": 0.02,
            },
            indent=2,
        )
    )
    (out / "generation_config.json").write_text(
        json.dumps(
            {
                "bos_token_id": 0,
                "eos_token_id": 1,
                "pad_token_id": 3,
            },
            indent=2,
        )
    )


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    out = Path(argv[1])
    out.mkdir(parents=True, exist_ok=True)
    vocab = make_tokenizer(out)
    # Round the embedding size up so the model covers every token id.
    make_config(out, max(VOCAB_SIZE, vocab))
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
