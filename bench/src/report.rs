//! The output of a benchmark: a Markdown report, CSV files of raw samples.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use super::BenchError;
use super::stats::{Summary, diff_pct};

/// A Markdown document being written.
#[derive(Debug, Default)]
pub struct Report {
    text: String,
}

impl Report {
    /// A report with a title.
    pub fn new(title: &str) -> Self {
        let mut r = Self::default();
        r.line(&format!("# {title}"));
        r.blank();
        r
    }

    /// One line.
    pub fn line(&mut self, s: &str) {
        self.text.push_str(s);
        self.text.push('\n');
    }

    /// An empty line.
    pub fn blank(&mut self) {
        self.text.push('\n');
    }

    /// A second-level heading.
    pub fn h2(&mut self, s: &str) {
        self.blank();
        self.line(&format!("## {s}"));
        self.blank();
    }

    /// A paragraph.
    pub fn para(&mut self, s: &str) {
        self.line(s);
        self.blank();
    }

    /// A table.
    pub fn table(&mut self, t: &Table) {
        self.text.push_str(&t.render());
        self.blank();
    }

    /// The text.
    pub fn text(&self) -> &str {
        &self.text
    }
}

/// A Markdown table.
#[derive(Debug, Clone)]
pub struct Table {
    header: Vec<String>,
    rows: Vec<Vec<String>>,
}

impl Table {
    /// A table with these column headers.
    pub fn new(header: &[&str]) -> Self {
        Self {
            header: header.iter().map(|s| s.to_string()).collect(),
            rows: Vec::new(),
        }
    }

    /// Adds a row.
    pub fn row(&mut self, cells: Vec<String>) {
        self.rows.push(cells);
    }

    /// Markdown text, columns padded for reading in a terminal.
    pub fn render(&self) -> String {
        let cols = self.header.len();
        let mut w = vec![3usize; cols];
        for r in std::iter::once(&self.header).chain(&self.rows) {
            for (i, c) in r.iter().enumerate().take(cols) {
                w[i] = w[i].max(c.chars().count());
            }
        }
        let fmt_row = |r: &[String]| {
            let mut s = String::from("|");
            for (i, wi) in w.iter().enumerate() {
                let c = r.get(i).map(String::as_str).unwrap_or("");
                let _ = write!(s, " {c:<wi$} |");
            }
            s.push('\n');
            s
        };
        let mut out = fmt_row(&self.header);
        out.push('|');
        for wi in &w {
            out.push_str(&format!("-{}-|", "-".repeat(*wi)));
        }
        out.push('\n');
        for r in &self.rows {
            out.push_str(&fmt_row(r));
        }
        out
    }
}

/// The header of a min/avg/max/sdev/spread table.
pub const SUMMARY_HEADER: [&str; 7] = ["n", "min", "avg", "max", "sdev", "spread", "vs base"];

/// Cells for a summary (seconds, 3 decimals) and its difference to `base`.
pub fn summary_cells(s: &Summary, base: Option<&Summary>) -> Vec<String> {
    vec![
        s.n.to_string(),
        format!("{:.3}", s.min),
        format!("{:.3}", s.avg),
        format!("{:.3}", s.max),
        format!("{:.3}", s.sdev),
        format!("{:.1}%", s.spread() * 100.0),
        match base {
            None => "base".into(),
            Some(b) => format!("{:+.2}%", diff_pct(s.avg, b.avg)),
        },
    ]
}

/// A CSV file of raw samples.
#[derive(Debug)]
pub struct Csv {
    text: String,
    cols: usize,
}

impl Csv {
    /// A CSV with this header.
    pub fn new(header: &[&str]) -> Self {
        let mut c = Self {
            text: String::new(),
            cols: header.len(),
        };
        c.push(header.iter().map(|s| s.to_string()).collect());
        c
    }

    /// Adds a record (fields quoted when needed).
    pub fn push(&mut self, fields: Vec<String>) {
        debug_assert_eq!(fields.len(), self.cols);
        let quoted: Vec<String> = fields
            .into_iter()
            .map(|f| {
                if f.contains([',', '"', '\n']) {
                    format!("\"{}\"", f.replace('"', "\"\""))
                } else {
                    f
                }
            })
            .collect();
        self.text.push_str(&quoted.join(","));
        self.text.push('\n');
    }

    /// The text.
    pub fn text(&self) -> &str {
        &self.text
    }
}

/// The output directory of one run.
#[derive(Debug, Clone)]
pub struct OutDir {
    /// Its path.
    pub path: PathBuf,
}

impl OutDir {
    /// `out`, or `bench-out/<kind>-<UTC timestamp>`; created.
    pub fn create(out: Option<&Path>, kind: &str) -> Result<Self, BenchError> {
        let path = match out {
            Some(p) => p.to_path_buf(),
            None => PathBuf::from("bench-out").join(format!("{kind}-{}", utc_stamp())),
        };
        std::fs::create_dir_all(&path)
            .map_err(|e| BenchError(format!("cannot create {}: {e}", path.display())))?;
        Ok(Self { path })
    }

    /// Writes a file in the directory.
    pub fn write(&self, name: &str, data: &[u8]) -> Result<PathBuf, BenchError> {
        let p = self.path.join(name);
        std::fs::write(&p, data)
            .map_err(|e| BenchError(format!("cannot write {}: {e}", p.display())))?;
        Ok(p)
    }

    /// A path in the directory.
    pub fn join(&self, name: &str) -> PathBuf {
        self.path.join(name)
    }
}

/// Current UTC time as `YYYYmmdd-HHMMSS`.
pub fn utc_stamp() -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    let (y, m, d) = civil_from_days((secs / 86_400) as i64);
    let s = secs % 86_400;
    format!(
        "{y:04}{m:02}{d:02}-{:02}{:02}{:02}",
        s / 3600,
        (s / 60) % 60,
        s % 60
    )
}

/// Days since 1970-01-01 to (year, month, day) (H. Hinnant's algorithm).
fn civil_from_days(z: i64) -> (i64, u32, u32) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let y = yoe + era * 400;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    (if m <= 2 { y + 1 } else { y }, m, d)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dates() {
        assert_eq!(civil_from_days(0), (1970, 1, 1));
        assert_eq!(civil_from_days(19_723), (2024, 1, 1));
        assert_eq!(civil_from_days(19_782), (2024, 2, 29));
    }

    #[test]
    fn table_and_csv() {
        let mut t = Table::new(&["a", "bb"]);
        t.row(vec!["1".into(), "2".into()]);
        let r = t.render();
        assert!(
            r.starts_with("| a   | bb  |\n|-----|-----|\n| 1   | 2   |"),
            "{r}"
        );
        let mut c = Csv::new(&["x", "y"]);
        c.push(vec!["a,b".into(), "q\"".into()]);
        assert_eq!(c.text(), "x,y\n\"a,b\",\"q\"\"\"\n");
    }
}
