from prefixgate.proxy.lru import LRU


def filled(capacity: int, *keys) -> LRU:
    lru = LRU(capacity)
    for k in keys:
        lru.put(k, k.upper())
    return lru


def test_get_refreshes_so_the_least_recent_is_evicted():
    lru = filled(3, "a", "b", "c")
    assert lru.get("a") == "A"
    lru.put("d", "D")
    assert "b" not in lru and list(lru) == ["c", "a", "d"]


def test_get_missing_returns_default_and_changes_nothing():
    lru = filled(2, "a", "b")
    assert lru.get("x") is None and lru.get("x", 0) == 0
    assert list(lru) == ["a", "b"]


def test_put_on_existing_key_updates_and_refreshes():
    lru = filled(2, "a", "b")
    lru.put("a", 1)
    assert len(lru) == 2 and list(lru) == ["b", "a"] and lru.peek("a") == 1
    lru.put("c", "C")
    assert list(lru) == ["a", "c"]


def test_capacity_one_keeps_only_the_last():
    lru = filled(1, "a")
    lru.put("b", "B")
    assert list(lru.items()) == [("b", "B")]
    lru.put("b", "b2")
    assert list(lru.items()) == [("b", "b2")]


def test_setitem_is_bounded_like_put():
    lru = LRU(2)
    lru["a"], lru["b"], lru["c"] = 1, 2, 3
    assert list(lru) == ["b", "c"]


def test_pop():
    lru = filled(3, "a", "b")
    assert lru.pop("a") == "A" and lru.pop("a") is None and lru.pop("a", 0) == 0
    assert list(lru) == ["b"] and len(lru) == 1


def test_contains_and_peek_do_not_refresh():
    lru = filled(2, "a", "b")
    assert "a" in lru and lru.peek("a") == "A" and lru.peek("x") is None
    lru.put("c", "C")
    assert "a" not in lru and list(lru) == ["b", "c"]
