"""tokenyard's processes: api, scheduler, worker, detokenizer, and the launcher that starts them."""
