"""jobs: precompute, the offline half: every pending chunk prefilled once, stored, embedded and indexed.

`precompute` is the job (one worker or several, resumable); `claims` how workers on any host share chunks in
SQL (leases, retries); `rows` the job rows and chunk counts; `launcher` starts a server's jobs as child
processes and watches them.

May import: config, errors, meta, database, store, corpus, parts (and blend, index).
"""
