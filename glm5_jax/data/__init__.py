"""Training data for glm5_jax: text sources, tokenizers, and the grain packing pipeline.

Public API:
    SourceSpec, Document, source_spec_from_dict, load_documents, split_documents
    load_tokenizer, train_bpe_tokenizer, load_or_train_tokenizer, token_byte_lengths,
    check_vocab_fits, end_of_text_id
    make_train_iterator(sources, tokenizer, *, seq_len, batch_size, seed, validation_fraction,
                        shard_index=0, shard_count=1) -> grain DatasetIterator of int32 [batch, seq_len]
    make_validation_batches(sources, tokenizer, *, seq_len, batch_size, seed, validation_fraction,
                            max_batches) -> list of batches
"""

from glm5_jax.data.pipeline import (
    make_train_iterator,
    make_validation_batches,
    training_documents,
    validation_documents,
)
from glm5_jax.data.sources import (
    DataPathNotFoundError,
    DataSourceError,
    Document,
    SourceSpec,
    load_documents,
    source_spec_from_dict,
    split_documents,
)
from glm5_jax.data.tokenizer import (
    END_OF_TEXT,
    VocabularyTooLargeError,
    check_vocab_fits,
    end_of_text_id,
    load_or_train_tokenizer,
    load_tokenizer,
    token_byte_lengths,
    train_bpe_tokenizer,
)

__all__ = [
    "END_OF_TEXT", "DataPathNotFoundError", "DataSourceError", "Document", "SourceSpec",
    "VocabularyTooLargeError", "check_vocab_fits", "end_of_text_id", "load_documents",
    "load_or_train_tokenizer", "load_tokenizer", "make_train_iterator", "make_validation_batches",
    "source_spec_from_dict", "split_documents", "token_byte_lengths", "train_bpe_tokenizer",
    "training_documents", "validation_documents",
]
