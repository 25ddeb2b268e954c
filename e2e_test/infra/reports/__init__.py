"""What a run leaves and how it reads: result files (results), the markdown report (report),
the CLI's verdict lines (verdicts), the HTML pages (html_report), the lane's time report
(time_report) and the headless-browser check of the pages (browser)."""
