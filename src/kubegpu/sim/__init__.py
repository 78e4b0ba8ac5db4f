"""The capacity planner: replays a GPU cluster trace through kubegpu's placement policies."""
