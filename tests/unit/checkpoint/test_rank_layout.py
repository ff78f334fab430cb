"""The restore log line names the layout saved and the layout now, and whether it was resharded."""

from spotrun.checkpoint.rank_layout import restored_onto


def test_the_restore_line_says_when_a_layout_change_at_the_same_world_size_was_resharded():
    fsdp2 = [{"shape": [2], "dim_names": ["dp"]}]
    assert restored_onto(5, 2, fsdp2, 2, fsdp2).endswith("onto 2 ranks, mesh 2 (the same world size)")
    assert restored_onto(5, 2, fsdp2, 2, []).endswith("onto 2 ranks (the same world size, another layout: resharded)")
    assert (
        restored_onto(5, 2, fsdp2, 3, [{"shape": [3], "dim_names": ["dp"]}])
        == "restored step 5 (saved by 2 ranks, mesh 2) onto 3 ranks, mesh 3 (another world size: resharded)"
    )
