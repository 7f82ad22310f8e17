"""Tensor parallelism: the ranks' process group (:mod:`~engine.parallel.group`), the model's
shards (:mod:`~engine.parallel.sharding`, :mod:`~engine.parallel.vocab`) and the worker
processes rank 0 drives (:mod:`~engine.parallel.executor`). docs/tensor-parallel.md has the
design; the cache's cross-rank agreement is :mod:`engine.cache.rank_agreement`."""
