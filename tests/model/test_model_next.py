"""GLM-5.3-Flash's model beyond transformers' reach: packed documents (transformers runs one
sequence per row) each equal to that document alone, through KDA (state and convolution
restart), pooled DSA (pools start at each document) and hyper-connections.""" 

import numpy as np
from next_models import random_next_params, tiny_next

import glm5_jax

CONFIG = tiny_next(index_topk=4)  # pools of 2, so the 13- and 11-token documents select sparsely
PARAMS = random_next_params(CONFIG, 3)


def test_packed_documents_equal_each_document_alone():
    first, second = 13, 11
    ids = np.random.default_rng(4).integers(2, CONFIG.vocab_size, first + second).astype(np.int32)
    positions = np.concatenate([np.arange(first), np.arange(second)])[None]
    packed = glm5_jax.forward(CONFIG, PARAMS, ids[None], positions, np.array([[1] * first + [2] * second]))
    # Each document alone at the start of its own row, padded with segment 0 after it.
    alone_ids = np.zeros((2, first + second), np.int32)
    alone_ids[0, :first], alone_ids[1, :second] = ids[:first], ids[first:]
    positions = np.tile(np.arange(first + second), (2, 1))
    segments = np.array([[1] * first + [0] * second, [1] * second + [0] * first])
    alone = np.asarray(glm5_jax.forward(CONFIG, PARAMS, alone_ids, positions, segments))
    packed = np.asarray(packed)[0]
    np.testing.assert_allclose(packed[:first], alone[0, :first], atol=2e-5)
    np.testing.assert_allclose(packed[first:], alone[1, :second], atol=2e-5)
