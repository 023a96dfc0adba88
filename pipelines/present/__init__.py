"""How figures reach people: the console's and the report's tables (console.py, report_tables.py), the charts
(charts.py), the capacity table and the frontier (capacity.py, frontier.py), the search's section
(search_section.py), the ship card (shipcard.py), the report (report.py) and the speed half's report
(speed_half.py). Units, colours and one-line summaries are pipelines/core/store/formats.py's, which MLflow's tags
share.

Results flow down to it: the stages and the gate hand it data and never import it. It imports pipelines/core/,
the gate's pricing (pipelines/decision/pricing.py, what it shows of cost is what the gate judged) and eval/; the
report logs through the tracker protocol of pipelines/core/.
"""
