import itertools

from ds4_mlx.stop import StopStrings


def stream(stops, pieces):
    s = StopStrings(stops)
    out = "".join(s.feed(p) for p in pieces) + s.flush()
    return out, s.hit


def test_earliest_match_wins_over_list_order():
    assert stream(["STOP", "END"], ["abc END x STOP"]) == ("abc ", True)


def test_match_split_across_every_boundary():
    text = "hello wor" + "STOP" + "ld"
    for i, j in itertools.combinations(range(1, len(text)), 2):
        assert stream(["STOP"], [text[:i], text[i:j], text[j:]]) == ("hello wor", True)


def test_no_stop_passes_everything_through():
    assert stream([], ["a", "b"]) == ("ab", False)
    assert stream(["zz"], ["az", "b", "z"]) == ("azbz", False)


def test_holds_back_only_what_could_start_a_stop_string():
    s = StopStrings(["END", "STOP"])
    assert s.feed("abcE") == "abc"
    assert s.feed("N") == ""
    assert s.feed("x") == "ENx"
    assert s.feed("ST") == ""
    assert s.flush() == "ST"
    assert StopStrings(["END"]).feed("no match here>") == "no match here>"


def test_nothing_after_a_hit():
    s = StopStrings(["X"])
    assert s.feed("aXb") == "a"
    assert s.feed("more") == ""
    assert s.flush() == ""
