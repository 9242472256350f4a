"""A GPT-2 style byte-level BPE trained in milliseconds on a tiny corpus: characters outside the corpus split into
single-byte tokens, which is what exercises incremental detokenization of multi-byte UTF-8."""

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

CORPUS = ["hello world, the quick brown fox jumps over the lazy dog.", "stop here and there; STOP now!"] * 20
EOS = "<eos>"  # token id 0


def byte_level_bpe() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    return tok
