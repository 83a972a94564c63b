"""`bench serve`'s bandwidth table on runs whose answers are known."""
from ragcache.bench.serve import _bandwidth


def test_the_bandwidth_table_gives_each_gain_against_the_bound_and_what_end_to_end_would_reach_were_decode_at_it():
    # 100 MB of weights, 25 MB of KV a sequence: at 16 a step reads 500 MB for 16 tokens, so the bound is 16·125/500 = 4
    one = {"wall": 2.0, "tokens": 64, "requests": 1, "decode": 1000.0}  # 1 s decoding, 1 s the rest of the request
    sixteen = {"wall": 8.0, "tokens": 1024, "requests": 16, "decode": 4000.0}  # 4x the tokens/s, 4 s of decode each
    rows = _bandwidth({("reuse", 1): one, ("reuse", 16): sixteen}, [1, 16], 100e6, 25e6).splitlines()
    cells = [c.strip() for c in rows[-1].strip("|").split("|")]
    assert cells == ["16", "500", "4", "4", "1", "4", "1", "0.4"]  # the rest, 1 s, stays: 2 / (1 + 1/4) / 4
    assert [c.strip() for c in rows[-2].strip("|").split("|")][-1] == "1"
