"""`vllm-overlay rebase`: move the series onto a newer vLLM base.

Each patch, in series order, is classified against the new base:

- ``clean``: applies exactly where its hunks say;
- ``offset``: applies, every line identical, but some hunks moved (named,
  with their offsets);
- ``upstream``: the new base already holds the change: the patch
  reverse-applies to it (offsets allowed), or a 3-way merge of the patch into
  the new base changes nothing. Proposed for removal; never reverse-applied;
- ``conflict``: neither. A 3-way merge (``git merge-file``: new base, old
  base, old base with the patch) is written with conflict markers to the work
  directory, with its three inputs, and the hunks that no longer apply are
  named. A patch that is upstream in one file but not in another is a
  conflict too ("partly upstream");
- ``blocked``: not assessed, because an earlier patch conflicts in a file it
  touches (its starting text on the new base is unknown).

The chain on the new base carries clean/offset patches forward and skips
upstream ones. Only when no patch conflicts or is blocked, and with
``--write``, the pin (new version, hashes, wheel) and the refreshed patches
(hunk headers and ``index`` lines recomputed against the new base; the hunk
bodies are unchanged) are written, and upstream patches are dropped from the
series. Otherwise the repository is left untouched and the exit status is 1.

The modules: ``newbase`` (the base to rebase onto: a wheel, a tree, a
version fetched with pip), ``classify`` (one patch's files against it),
``plan`` (the series walked patch by patch, and what ``--write`` writes)
and ``report`` (the result, as a table and as JSON).
"""
