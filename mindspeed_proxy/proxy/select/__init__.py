"""Expert selection: similarity, clustering, reconstruction search, merge; pure numpy/torch, no IO."""
