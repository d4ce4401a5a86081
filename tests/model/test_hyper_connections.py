"""Manifold-constrained hyper-connections (glm5_jax/model/hyper_connections.py) against
transformers 5.24's glm5_next modules, float32, random weights (not the init's zero base and unit
scale): the collapse weights, the doubly stochastic stream mixing, the expansion as the
reference decoder layer writes it, and the final mean."""

import numpy as np
import pytest
import torch
from transformers.models.glm5_next import modeling_glm5_next as reference
from transformers.models.glm5_next.configuration_glm5_next import Glm5NextTextConfig

from glm5_jax.model.hyper_connections import HyperSpec, expand_streams, hyper_connection, hyper_head


@pytest.mark.parametrize("streams", [2, 4])
def test_hyper_connection_equals_the_reference(streams):
    hidden, batch, length = 16, 2, 5
    config = Glm5NextTextConfig(hidden_size=hidden, hc_mult=streams, hc_sinkhorn_iters=7, rms_norm_eps=1e-6)
    module = reference.Glm5NextTextHyperConnection(config).float()
    rng = np.random.default_rng(streams)
    with torch.no_grad():
        for parameter in module.parameters():
            parameter.copy_(torch.from_numpy(rng.standard_normal(parameter.shape).astype(np.float32)))
    x = rng.standard_normal((batch, length, streams, hidden)).astype(np.float32)
    block_out = rng.standard_normal((batch, length, hidden)).astype(np.float32)
    with torch.no_grad():
        post, comb, collapsed = module(torch.from_numpy(x))
        expanded = post.unsqueeze(-1) * torch.from_numpy(block_out).unsqueeze(-2) + torch.matmul(
            comb.transpose(-1, -2), torch.from_numpy(x))  # as Glm5NextTextDecoderLayer.forward
    spec = HyperSpec(streams, hidden, config.hc_sinkhorn_iters, config.hc_eps, config.rms_norm_eps)
    weights = {name: np.asarray(p.detach()) for name, p in module.named_parameters()}
    weights["fn"] = weights["fn"].T  # ours [in, out], as every matrix here
    got_post, got_comb, got_collapsed = hyper_connection(spec, weights, x)
    for got, want in ((got_post, post), (got_comb, comb), (got_collapsed, collapsed)):
        np.testing.assert_allclose(np.asarray(got), want.numpy(), atol=2e-5, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(got_comb).sum(-2), 1.0, atol=1e-5)  # columns sum to 1
    np.testing.assert_allclose(np.asarray(expand_streams(got_post, got_comb, block_out, x)), expanded.numpy(),
                               atol=2e-5, rtol=1e-5)
    head = reference.Glm5NextTextHyperHead()(torch.from_numpy(x))
    np.testing.assert_allclose(np.asarray(hyper_head(x)), head.numpy(), atol=1e-6)
