"""What identifies a run and where its result came from: the content fingerprints of the files a run reads
(``fingerprint``) and of the text a method learned from offline, checked against the text a run evaluates
(``overlap``), the one seed its random draws come from and the runs that differ only in it (``seeds``), and the
provenance written beside its records (``provenance``: commit, the diff of a dirty checkout, versions, hardware).

Near the ground floor: ``fingerprint``, ``overlap`` and ``provenance`` import no project module; ``seeds`` asks the
methods whether one is stochastic and the store for a config's hash, inside its functions, so every wing may import
this one."""
