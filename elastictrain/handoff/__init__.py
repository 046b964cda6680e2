"""Files a node's workers and their agent exchange (the two processes share nothing else
on a node): rescue marks and end marks. Imported by both sides, importing neither."""
