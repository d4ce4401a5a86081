"""Training data for glm5_jax: text sources, tokenizers, and the grain packing pipeline.

Public API:
    SourceSpec, Document, source_spec_from_dict, load_documents, split_documents
    load_tokenizer, train_bpe_tokenizer, load_or_train_tokenizer, token_byte_lengths,
    check_vocab_fits, end_of_text_id
    make_train_iterator(sources, tokenizer, *, seq_len, batch_size, seed, validation_fraction)
                        -> grain DatasetIterator of int32 [batch, seq_len] (the global batch)
    make_validation_batches(sources, tokenizer, *, seq_len, batch_size, seed, validation_fraction,
                            max_batches) -> list of batches

Names are imported on first use: reading sources needs neither grain nor JAX.
"""

from glm5_jax import lazy_exports

_MODULES = {
    "glm5_jax.data.pipeline": ("make_train_iterator", "make_validation_batches", "training_documents",
                               "validation_documents"),
    "glm5_jax.data.sources": ("DataPathNotFoundError", "DataSourceError", "Document", "SourceSpec",
                              "load_documents", "source_spec_from_dict", "split_documents"),
    "glm5_jax.data.tokenizer": ("END_OF_TEXT", "VocabularyTooLargeError", "check_vocab_fits",
                                "end_of_text_id", "load_or_train_tokenizer", "load_tokenizer",
                                "token_byte_lengths", "train_bpe_tokenizer"),
}
_EXPORTS = {name: module for module, names in _MODULES.items() for name in names}
__all__ = sorted(_EXPORTS)


__getattr__ = lazy_exports(__name__, _EXPORTS, globals())
