"""tasks/traffic/rollout.py: how many instances each side of a red-black step runs."""

from tasks.traffic.rollout import instances_for


def test_instance_counts_follow_the_weights():
    assert [instances_for(w, 4) for w in (10, 25, 50, 100)] == [1, 1, 2, 4]
    assert [instances_for(100 - w, 4) for w in (10, 25, 50, 100)] == [4, 3, 2, 0]
    assert [instances_for(w, 1) for w in (0, 10, 100)] == [0, 1, 1]
