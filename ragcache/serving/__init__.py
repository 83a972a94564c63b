"""serving: the one thread that owns the model, and what feeds it.

A request is prepared off the model thread (`prep`: tokenize, retrieve, load chunk KV), waits at the door
and for KV budget (`admission`: tenants' shares, in turn by `fair`), is prefilled and decoded in batches with
the others (`scheduler`; `decoding` its running sequences' part, `piecewise` a long prompt's; `alone`
retries a failed batch an item at a time), and streams its text (`sequence`, `textstream`). `policy` picks
its repair policy; under `deferred`, `repair` fuses it again after its first token.

Three threads: the prep thread (`prep.PrepThread`) does what is not model work, tenants in turn, so that it
overlaps decoding; the side worker (`side`) runs work items (ingest, warm-up) and custom prompt heads'
prefills, which would stall the prep thread, those heads' KV kept by `prefixes`; the model thread
(`scheduler`) runs every model step. `generation` is the same pipeline for one request alone, `explain` and
`recent` what a person looks at afterwards, `tally` the counters /metrics reads.

May import: config, errors, meta, database, store, corpus (and blend, index).
"""
