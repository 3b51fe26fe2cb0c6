"""Helpers shared by the tests: fake peers, rank fixtures, namespaces, engine drivers.

Modules here that run as scripts in a child process and import a sibling
(``netns_ranks``, ``sglang_rank``) put the tests folder on ``sys.path`` first,
so that ``support`` imports the same way in the child as in the test."""
