"""bench/block_maxscore.py: the MaxScore split and the early stop, counted by hand."""

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

from block_maxscore import query_blocks, split_n


def test_split_takes_the_smallest_bounds_while_their_sum_fits():
    bounds = np.array([[0.125, 0.5, 0.25, 0.0], [0.5, 0.5, 0.5, 0.5]])
    every = np.ones_like(bounds, dtype=bool)
    # row 0: 0.125 + 0.25 = 0.375 fits exactly (at the budget, not only below it); 0.5 more does not
    np.testing.assert_array_equal(
        split_n(bounds, every, np.array([0.375, 1.0])), [[True, False, True, False], [True, True, False, False]]
    )
    # a term not eligible is skipped over, and an absent one (bound 0) never goes to N
    eligible = np.array([[False, True, True, True], [True] * 4])
    np.testing.assert_array_equal(
        split_n(bounds, eligible, np.array([1.0, 0.0])), [[False, True, True, False], [False] * 4]
    )


def _cols():
    # tiles of 2 documents: tile 0 = documents 0, 1 (the first waves), tile 1 = documents 2, 3
    return [
        (np.array([0, 2, 3]), np.array([4.0, 1.0, 1.0])),  # t0: bound 1 in tile 1, a dense row there
        (np.array([2, 3]), np.array([0.5, 0.25])),  # t1: bound 0.5, dense
        (np.array([3]), np.array([0.25])),  # t2: bound 0.25, sparse (one posting)
    ]


def test_a_block_stops_when_no_document_can_reach_theta():
    # theta = 4 (k = 1 over tile 0); dense rows: two postings in a tile of two (dense_min 1)
    rec = query_blocks(_cols(), 4, 1, [0.125, 0.25, 0.5], tile_bits=1, first_tiles=1, dense_min=1.0)
    assert (rec["blocks"], rec["sparse_postings"], rec["dense_rows"], rec["blocks_with_dense"]) == (1, 1, 2, 1)
    f = rec["forms"]
    # budget 0.5: N = {t2}; the sums without it 1.5, 1.25: 1.5 + 0.25 < 4, the block stops
    assert f["sparse@0.125"] == {
        "stop_blocks": 1,
        "sparse_postings_unread": 1,
        "n_sparse_postings": 1,
        "dense_rows_unread": 0,
        "dense_blocks_reading_none": 0,
    }
    # mixed, budget 1: N = {t2, t1} (0.75); budget 2: all three (1.75), no dense row read
    assert f["mixed@0.25"]["dense_rows_unread"] == 1 and f["mixed@0.25"]["dense_blocks_reading_none"] == 0
    assert f["mixed@0.5"]["dense_rows_unread"] == 2 and f["mixed@0.5"]["dense_blocks_reading_none"] == 1
    # sparse form: dense rows never go to N, however large the budget
    assert f["sparse@0.5"]["dense_rows_unread"] == 0


def test_a_block_that_could_reach_theta_reads_everything():
    cols = _cols()
    # theta = 1.75, budget 0.4375: N = {t2}, the bound 1.5 + 0.25 = 1.75 is not below theta: no stop
    cols[0] = (np.array([0, 2, 3]), np.array([1.75, 1.0, 1.0]))
    rec = query_blocks(cols, 4, 1, [0.25], tile_bits=1, first_tiles=1, dense_min=1.0)
    assert rec["forms"]["sparse@0.25"]["stop_blocks"] == 0
    assert rec["forms"]["sparse@0.25"]["sparse_postings_unread"] == 0
