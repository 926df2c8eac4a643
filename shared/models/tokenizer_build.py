"""Offline byte-level BPE tokenizer and chat template for tiny Qwen2-VL test models.
``build_qwen2_tokenizer(seed, vocab_size)`` trains a byte-level BPE with ``tokenizers`` on a
corpus generated in code (deterministic for a seed) and returns a ``Qwen2Tokenizer`` whose
pre-tokenizer, normaliser and decoder are exactly the ones it rebuilds from ``vocab`` /
``merges`` when loaded again, so a saved and reloaded tokenizer encodes identically. Qwen2-VL's
special tokens (``SPECIAL_TOKENS``) are registered as special; callers read their ids back
from the tokenizer. ``CHAT_TEMPLATE`` renders Qwen2-VL prompts without a default system prompt.

Design: docs/guide/models.md.
"""

from __future__ import annotations

import random

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
VISION_START = "<|vision_start|>"
VISION_END = "<|vision_end|>"
IMAGE_PAD = "<|image_pad|>"
VIDEO_PAD = "<|video_pad|>"

SPECIAL_TOKENS: tuple[str, ...] = (
    ENDOFTEXT,
    IM_START,
    IM_END,
    VISION_START,
    VISION_END,
    IMAGE_PAD,
    VIDEO_PAD,
)

# Same split regex as transformers' Qwen2Tokenizer; training with it keeps the merges
# consistent with the pipeline Qwen2Tokenizer rebuilds at load time.
_QWEN2_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

# Qwen2-VL style template.  Content is a string or a list of parts; image parts
# (``image`` / ``image_url``) render as one placeholder wrapped in vision markers,
# video parts as the video placeholder.  Deliberately no default system prompt:
# the prompt is exactly the messages given, which keeps token counts predictable.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\n' -}}"
    "{%- if message['content'] is string -%}"
    "{{- message['content'] -}}"
    "{%- else -%}"
    "{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'text' -%}"
    "{{- part['text'] -}}"
    "{%- elif part['type'] in ['image', 'image_url'] or 'image' in part or 'image_url' in part -%}"
    "{{- '<|vision_start|><|image_pad|><|vision_end|>' -}}"
    "{%- elif part['type'] in ['video', 'video_url'] or 'video' in part -%}"
    "{{- '<|vision_start|><|video_pad|><|vision_end|>' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{{- '<|im_end|>\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|im_start|>assistant\n' -}}"
    "{%- endif -%}"
)

_SUBJECTS = (
    "the cat", "a dog", "the red bird", "my friend", "the old man", "a small child", "the teacher",
    "our team", "the robot", "a green frog", "the blue car", "this picture", "the image", "a photo",
    "the model", "the server", "a student", "the doctor", "her brother", "the garden",
)
_VERBS = (
    "sees", "shows", "holds", "likes", "paints", "describes", "finds", "moves", "watches", "draws",
    "contains", "carries", "follows", "builds", "reads", "writes", "opens", "answers", "counts", "colors",
)
_OBJECTS = (
    "a bright square", "the yellow sun", "three apples", "a wooden table", "the dark sky", "two circles",
    "a long river", "the white wall", "some purple flowers", "a striped shirt", "the empty room",
    "a tall tree", "four windows", "the orange box", "a gray stone", "the noisy street", "a quiet lake",
    "many colors", "a soft gradient", "random noise",
)
_TAILS = (
    "today", "in the morning", "at night", "near the door", "on the left", "on the right", "very slowly",
    "with care", "again and again", "for a while", "in the middle", "at the top", "at the bottom",
    "because it is fun", "without a word", "under the light",
)
# A few non-ASCII words so some merges span multi-byte UTF-8 characters.
_EXTRA = (
    "café", "naïve", "über", "héllo", "wörld", "smörgåsbord", "façade", "jalapeño", "日本", "東京",
    "こんにちは", "привет", "Ελλάδα", "😀", "🚀", "€", "°C", "—",
)
# Common words so the BPE has enough material to reach ~1000-2000 merges.
_WORDS = tuple(
    """
    time year people way day thing world life hand part place case week company system program question
    work government number night point home water room mother area money story fact month lot right study
    book eye job word business issue side kind head house service friend father power hour game line end
    member law car city community name president team minute idea kid body information back parent face
    others level office door health person art war history party result change morning reason research girl
    guy moment air teacher force education foot boy age policy everything process music market sense nation
    plan college interest death experience effect use class control care field development role effort rate
    heart drug show leader light voice wife police mind price report decision son view relationship town
    road arm difference value building action model season society tax director position player record paper
    space ground form event official matter center couple site project activity star table need court oil
    situation cost industry figure street image phone data picture practice piece land product doctor wall
    patient worker news test movie north love support technology step baby computer type attention film tree
    source organization hair window evidence population truth song energy army chance kitchen blue yellow
    purple orange silver golden bright dark quick slow happy quiet loud strong gentle simple complex round
    square circle triangle stripe pattern shadow corner border surface texture pixel token number letter
    running jumping walking talking thinking looking reading writing painting building moving sleeping
    beautiful wonderful important different possible available popular traditional international natural
    """.split()
)
_QUESTIONS = (
    "What is in the image?", "Describe the picture.", "What color is it?", "How many objects are there?",
    "Is it day or night?", "What does the photo show?", "Tell me a story.", "Answer briefly.",
)


def generate_corpus(seed: int, n_sentences: int = 3000) -> list[str]:
    """Deterministic English-like corpus (plus digits and a few non-ASCII words)."""
    rng = random.Random(seed)
    lines: list[str] = []
    for i in range(n_sentences):
        sentence = f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)} {rng.choice(_TAILS)}"
        sentence = sentence[0].upper() + sentence[1:]
        kind = i % 6
        if kind == 0:
            sentence += f", {rng.randint(0, 999)} times."
        elif kind == 1:
            sentence += f" {rng.choice(_EXTRA)} {rng.choice(_EXTRA)}!"
        elif kind == 2:
            sentence = f"{rng.choice(_QUESTIONS)} {sentence}."
        elif kind == 3:
            sentence += f"; it's {rng.choice(_EXTRA)}."
        else:
            sentence += "."
        # Append a random run of common words for vocabulary variety.
        sentence += " " + " ".join(rng.choice(_WORDS) for _ in range(rng.randint(3, 9)))
        lines.append(sentence)
    return lines


def train_byte_level_bpe(seed: int, vocab_size: int) -> Tokenizer:
    """Train a Qwen2-pipeline byte-level BPE; special tokens get the lowest ids."""
    tok = Tokenizer(models.BPE(unk_token=None, byte_fallback=False, fuse_unk=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_QWEN2_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        # Every byte must be in the vocabulary so arbitrary text round-trips.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(generate_corpus(seed), trainer=trainer)
    return tok


def build_qwen2_tokenizer(seed: int = 0, vocab_size: int = 1536):
    """Return a ``Qwen2Tokenizer`` built from a freshly trained BPE.

    eos = ``<|im_end|>`` (the chat turn terminator), pad = unk = ``<|endoftext|>``,
    no bos.  The chat template is attached.
    """
    from transformers import Qwen2Tokenizer

    trained = train_byte_level_bpe(seed, vocab_size)
    model_json = _bpe_vocab_and_merges(trained)
    tokenizer = Qwen2Tokenizer(
        vocab=model_json["vocab"],
        merges=model_json["merges"],
        unk_token=ENDOFTEXT,
        bos_token=None,
        eos_token=IM_END,
        pad_token=ENDOFTEXT,
        extra_special_tokens=[t for t in SPECIAL_TOKENS if t not in (ENDOFTEXT, IM_END)],
        model_max_length=32768,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    # Sanity: the wrapped tokenizer must tokenize like the trained one.
    probe = "Héllo wörld 日本, the cat sees 3 apples! <|im_start|>user\n"
    if tokenizer(probe)["input_ids"] != trained.encode(probe).ids:
        raise RuntimeError("Qwen2Tokenizer does not reproduce the trained BPE")
    return tokenizer


def _bpe_vocab_and_merges(tok: Tokenizer) -> dict:
    import json

    model = json.loads(tok.to_str())["model"]
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    return {"vocab": dict(model["vocab"]), "merges": merges}
