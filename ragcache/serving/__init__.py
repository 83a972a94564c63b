"""serving: the one thread that owns the model, and what feeds it.

A request is prepared off the model thread (`prep`: tokenize, retrieve, load chunk KV), waits at the door
and for KV budget (`admission`: tenants' shares, in turn by `fair`), is prefilled and decoded in batches with
the others (`scheduler`, `piecewise` for a long prompt), and streams its text (`sequence`, `textstream`);
ingests and custom prompt heads' prefills run on the `side` worker, those heads' KV kept by `prefixes`.
`generation` is the same pipeline for one request alone, `explain` and `recent` what a person looks at
afterwards, `tally` the counters /metrics reads.

May import: config, errors, meta, database, store, corpus (and blend, index).
"""
