"""MLflow's record of a search (`vidtune.tune.tracking`): one parent run per search, one child
run per trial, all written from the search's driver process.

- `tracker`: `MLflowTracker`, the Tune callback that decides which runs exist and when to write,
  and records the end-of-search summary it is handed (`tune.summary.Summary`).
- `runs`: what goes into a run (`RunWriter`, mixed into the tracker).
- `description`: the parent run as the UI opens it (saved view, links, description).
- `view`: the UI's formats (saved runs-table view, link shapes), checked per MLflow version.
- `schema`: the names of the tags and metrics, read by the writer, bench/ and the tests.
- `store`: the checks of a tracking or study store before anything starts (`tune.preflight`).

Nothing is imported here, so `store` and `schema` load without MLflow's client or Ray's callbacks.
"""
