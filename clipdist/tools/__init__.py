"""Tools around training: gradcheck, plan, bench, memory measurement, and examples of wrong losses."""
