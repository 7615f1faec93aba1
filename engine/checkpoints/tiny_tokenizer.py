"""Offline tokenizers for the tiny test models (``pdserve make-tiny-model --tokenizer bpe|metaspace``).

Two families, because detokenization differs between them:

    bpe        byte-level BPE (GPT-2 / Qwen / SmolLM style): every token decodes to its own bytes,
               a leading space is part of the token. ChatML template, eos <|im_end|>.
    metaspace  SentencePiece-style BPE (Llama-2 / Mistral-v0.1 style): spaces become "▁", the
               decoder strips the first "▁" of a decoded sequence (so a lone "▁a" decodes to "a"),
               unknown characters fall back to <0xXX> byte tokens; <s> is prepended on encode.
               ids: <unk> 0, <s> 1, </s> 2, then the 256 byte tokens, then the trained pieces.

Both are trained on ``corpus_lines()``; everything is a pure function of the code (no downloads).
"""

from __future__ import annotations

from dataclasses import dataclass

TOKENIZER_VOCAB = 512
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")   # bpe: ids 0, 1, 2
ENDOFTEXT_ID, IM_START_ID, IM_END_ID = 0, 1, 2
SP_SPECIAL_TOKENS = ("<unk>", "<s>", "</s>")                       # metaspace: ids 0, 1, 2
SP_UNK_ID, SP_BOS_ID, SP_EOS_ID = 0, 1, 2

CHATML_TEMPLATE = (   # ChatML; with tools, Hermes style (Qwen2.5's layout): the tools in the system turn,
    # calls as <tool_call>{"name", "arguments"}</tool_call>, results as <tool_response> in a user turn
    "{% if tools %}{{ '<|im_start|>system\\n' }}"
    "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] + '\\n\\n' }}{% endif %}"
    "{{ '# Tools\\n<tools>' }}{% for tool in tools %}{{ '\\n' + (tool['function'] | tojson) }}{% endfor %}"
    "{{ '\\n</tools>\\nCall a tool as <tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call><|im_end|>\\n' }}"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if tools and loop.first and message['role'] == 'system' %}"
    "{% elif message['role'] == 'tool' %}"
    "{{ '<|im_start|>user\\n<tool_response>\\n' + message['content'] + '\\n</tool_response><|im_end|>\\n' }}"
    "{% else %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] }}"
    "{% for call in message['tool_calls'] or [] %}"
    "{{ '<tool_call>\\n{\"name\": \"' + call['function']['name'] + '\", \"arguments\": ' }}"
    "{{ (call['function']['arguments'] if call['function']['arguments'] is string "
    "else call['function']['arguments'] | tojson) + '}\\n</tool_call>' }}"
    "{% endfor %}"
    "{{ '<|im_end|>' + '\\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
INST_TEMPLATE = (   # Llama-2 style turns; the generation prompt opens an answer
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}{{ ' ' + message['content'] + eos_token }}"
    "{% else %}{{ '[INST] ' + message['content'] + ' [/INST]' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ ' Answer:' }}{% endif %}"
)


@dataclass(frozen=True)
class TokenizerFlavour:
    """What ``make_tiny_model`` writes next to the weights for one tokenizer kind."""
    chat_template: str
    bos_token: str | None
    eos_token: str
    pad_token: str | None
    unk_token: str | None
    bos_id: int
    pad_id: int
    eos_ids: tuple[int, ...]       # generation_config's eos list; the first is config.json's eos

    def build(self, name: str):
        return build_bpe_tokenizer() if name == "bpe" else build_metaspace_tokenizer()


FLAVOURS = {
    "bpe": TokenizerFlavour(CHATML_TEMPLATE, None, "<|im_end|>", "<|endoftext|>", None, ENDOFTEXT_ID,
                            ENDOFTEXT_ID, (IM_END_ID, ENDOFTEXT_ID)),
    "metaspace": TokenizerFlavour(INST_TEMPLATE, "<s>", "</s>", None, "<unk>", SP_BOS_ID, SP_UNK_ID,
                                  (SP_EOS_ID,)),
}


def build_bpe_tokenizer():
    """Byte-level BPE trained on the corpus: specials at ids 0-2, then the 256 bytes, then merges."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=TOKENIZER_VOCAB, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(corpus_lines(), trainer=trainer)
    return tokenizer


def build_metaspace_tokenizer():
    """SentencePiece-style BPE with byte fallback, laid out like Llama-2's tokenizer.json."""
    import json

    from tokenizers import Tokenizer, decoders, models, processors, trainers

    trained = Tokenizer(models.BPE(unk_token="<unk>"))
    trained.normalizer = _metaspace_normalizer()
    trained.pre_tokenizer = _word_splitter()
    trainer = trainers.BpeTrainer(vocab_size=TOKENIZER_VOCAB, special_tokens=list(SP_SPECIAL_TOKENS),
                                  show_progress=False)
    trained.train_from_iterator(corpus_lines(), trainer=trainer)
    model = json.loads(trained.to_str())["model"]
    pieces = [p for p, _ in sorted(model["vocab"].items(), key=lambda kv: kv[1]) if p not in SP_SPECIAL_TOKENS]
    order = [*SP_SPECIAL_TOKENS, *(f"<0x{b:02X}>" for b in range(256)), *pieces]
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    tokenizer = Tokenizer(models.BPE(vocab={p: i for i, p in enumerate(order)}, merges=merges, unk_token="<unk>",
                                     byte_fallback=True, fuse_unk=True))
    tokenizer.add_special_tokens(list(SP_SPECIAL_TOKENS))
    tokenizer.normalizer = _metaspace_normalizer()
    tokenizer.pre_tokenizer = _word_splitter()
    tokenizer.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                           decoders.Strip(" ", 1, 0)])
    tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                             special_tokens=[("<s>", SP_BOS_ID)])
    return tokenizer


def _metaspace_normalizer():
    from tokenizers import normalizers

    return normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])


def _word_splitter():
    """Pieces never cross a word start (SentencePiece's split_by_whitespace)."""
    from tokenizers import pre_tokenizers

    return pre_tokenizers.Split("▁", behavior="merged_with_next")


_SUBJECTS = ("The old sailor", "A curious child", "My neighbour", "The quiet engineer", "Every student",
             "The tired doctor", "Our small team", "A hungry fox", "The city council", "Her younger brother",
             "The red train")
_VERBS = ("carefully painted", "quickly repaired", "never forgot", "slowly climbed", "happily shared",
          "suddenly noticed", "often visited", "bravely crossed", "politely asked about", "finally opened",
          "loudly praised", "gently moved", "proudly built")
_OBJECTS = ("the wooden bridge", "a bright yellow kite", "the library near the river", "three green apples",
            "the broken clock", "a letter from Paris", "the mountain path", "an empty glass jar",
            "the noisy market", "a map of the island", "the winter garden", "forty-two paper boats",
            "the silver key", "a warm loaf of bread", "the final exam", "the server logs", "a cup of tea")
_ENDINGS = (".", "!", " yesterday.", " in 1999.", " before noon.", "?", " on Monday, 3 May.")


def corpus_lines() -> list[str]:
    """A few KB of varied English, built by index arithmetic so it never changes."""
    lines = [f"{_SUBJECTS[i % 11]} {_VERBS[i * 7 % 13]} {_OBJECTS[i * 5 % 17]}{_ENDINGS[i % 7]}"
             for i in range(160)]
    lines += ["What is the capital of France? Paris is the capital of France.",
              "Count with me: 1, 2, 3, 4, 5, 6, 7, 8, 9, 10.",
              "def add(a, b):\n    return a + b  # small code, tabs\tand newlines",
              "Hello, world! How are you today? I am fine, thank you.",
              "user: tell me a story. assistant: Once upon a time there was a tiny model.",
              "system: you are a helpful assistant. user: hi! assistant: Hello! How can I help you?"]
    return lines
